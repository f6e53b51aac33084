"""The checks of `SafeDistributedModel.from_model()`: the model it can wrap, and what wrapping would lose."""

import warnings

import keras

from keras_safe_dist import _compat
from keras_safe_dist.core import _validate

# What a wrapped model's class could change in training that from_model() would drop.
_STEP_METHODS = ("compute_loss", "train_step", "test_step")


def refuse_overridden_steps(model):
    """Raises a `TypeError` when `model`'s own class changes the step or the loss."""
    for klass in type(model).__mro__:
        if klass.__module__.split(".")[0] in ("keras", "keras_safe_dist", "builtins"):
            continue
        overridden = [name for name in _STEP_METHODS if name in vars(klass)]
        if overridden:
            raise TypeError(
                f"SafeDistributedModel.from_model() copies the layers of model "
                f"'{model.name}', not its class, and {klass.__name__} overrides "
                f"{', '.join(f'`{name}`' for name in overridden)}: the wrapped model would "
                "train without it. Mix SafeDistributedModel into that class instead, "
                f"`class Safe{klass.__name__}(SafeDistributedModel, {klass.__name__})`, "
                "and build the model from it (docs/model.md)."
            )


def warn_if_saved_twice(model, wrapped):
    """Warns when a layer of `wrapped` is also inside another of its layers (tied weights).

    Keras saves such a layer's variables once, at the first place it meets
    it, and loading then finds none at the other (keras-hub's causal LMs
    call their backbone's token embedding again for the logits): the result
    trains, but a file it saves cannot be loaded, as with
    `keras.Model(model.inputs, model.outputs)` in stock Keras.
    """
    top = list(wrapped.layers)
    nested = {}
    for layer in top:
        for inner in _compat.flatten_layers(layer):
            nested.setdefault(id(inner), layer)
    for layer in top:
        outer = nested.get(id(layer))
        if outer is None or outer is layer or not layer.weights:
            continue  # input layers are shared with a nested model, and have no variables
        klass = type(model).__name__
        warnings.warn(
            f"SafeDistributedModel.from_model({klass}): layer {layer.name!r} is called by "
            f"the model and also inside its layer {outer.name!r} (tied weights). The result "
            "trains and predicts as the model does, but a .keras file it saves cannot be "
            f"loaded: Keras saves {layer.name!r}'s variables once and finds none for it at "
            f"the other place (stock keras.Model(inputs, outputs) does the same). To save "
            f"and load, mix SafeDistributedModel into the class instead: `class "
            f"Safe{klass}(SafeDistributedModel, {klass})`.",
            stacklevel=3,
        )
        return


def model_graph(model, input_shape):
    """`(inputs, outputs)` of a Sequential or functional `model`, built if needed."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "SafeDistributedModel.from_model() takes a keras.Model (a Sequential "
            f"or functional model). Received: {type(model).__name__} {model!r}"
        )
    if input_shape is not None and (
        not isinstance(input_shape, (tuple, list))
        or not all(d is None or _validate.is_integer_at_least(d, 1) for d in input_shape)
    ):
        raise TypeError(
            "SafeDistributedModel.from_model()'s `input_shape` is the shape of one "
            "sample, a tuple of positive integers (None for a dimension of any "
            f"size). Received: input_shape={input_shape!r}. For samples of 8 "
            "features pass input_shape=(8,)."
        )
    if isinstance(model, keras.Sequential) and input_shape is not None:
        shape = (None, *tuple(input_shape))
        if not model.built or not _has_inputs(model):
            model.build(shape)
        built = tuple(model.inputs[0].shape)
        if len(built) != len(shape) or any(
            a is not None and b is not None and a != b for a, b in zip(built, shape)
        ):
            raise ValueError(
                f"`input_shape` must match the shape model '{model.name}' was "
                f"built with, {built[1:]} per sample. Received: "
                f"input_shape={tuple(input_shape)}"
            )
    if isinstance(model, keras.Sequential) and not _has_inputs(model):
        raise ValueError(
            f"SafeDistributedModel.from_model() needs the input shape of "
            f"Sequential model '{model.name}', which has no `Input` and was "
            "never built. Pass the shape of one sample, e.g. "
            "`SafeDistributedModel.from_model(model, input_shape=(8,))`, start "
            "the Sequential with `keras.Input((8,))`, or call "
            "`model.build((None, 8))` first."
        )
    inputs = _has_inputs(model) and model.inputs
    outputs = inputs and model.outputs
    if not inputs or not outputs:
        raise TypeError(
            "SafeDistributedModel.from_model() takes a Sequential or functional "
            "model, whose inputs and outputs it reuses. Received: a subclassed "
            f"model of class {type(model).__name__}, which has none. Subclass "
            "SafeDistributedModel instead of keras.Model (its `call()` stays "
            "the same)."
        )
    return inputs, outputs


def _has_inputs(model):
    """Whether `model` has symbolic inputs (a Sequential gets them when built)."""
    try:
        return bool(model.inputs)
    except AttributeError:
        return False
