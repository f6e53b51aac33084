"""SafeDistributedModel's options (`update/options.py`): each checked as given,
assigned or misspelled, and an optimizer's own clipping or accumulation refused."""

import keras
import pytest

from keras_safe_dist import SafeDistributedModel


def functional(**options):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(3, activation="tanh")(inputs))
    return SafeDistributedModel(inputs=inputs, outputs=outputs, **options)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"gradient_accumulation_steps": 0}, "`gradient_accumulation_steps` must be an integer >= 1. Received: gradient_accumulation_steps=0"),
        ({"gradient_accumulation_steps": 2.0}, "Received: gradient_accumulation_steps=2.0"),
        ({"gradient_accumulation_steps": True}, "Received: gradient_accumulation_steps=True"),
        ({"global_clipnorm": 0.0}, "`global_clipnorm` must be a finite number > 0 or None. Received: global_clipnorm=0.0"),
        ({"clipnorm": -1}, "`clipnorm` must be a finite number > 0 or None. Received: clipnorm=-1"),
        ({"clipvalue": "1"}, "Received: clipvalue='1'"),
        ({"clipvalue": float("nan")}, "Received: clipvalue=nan"),
        ({"clipnorm": 1.0, "clipvalue": 2.0}, "Only one of `global_clipnorm`, `clipnorm` and `clipvalue` can be set. Received: global_clipnorm=None, clipnorm=1.0, clipvalue=2.0"),
        ({"skip_nonfinite": 1}, "`skip_nonfinite` must be True or False. Received: skip_nonfinite=1"),
        ({"accumulation_dtype": "int32"}, "`accumulation_dtype` must be None or one of 'bfloat16', 'float32', 'float64'. Received: accumulation_dtype='int32'"),
        ({"accumulation_dtype": "fp32"}, "Received: accumulation_dtype='fp32'"),
        ({"accumulation_dtype": 32}, "Received: accumulation_dtype=32"),
        ({"accumulation_dtype": "float16"}, "`accumulation_dtype` cannot be 'float16': the sums hold a group's summed gradient"),
    ],
)
def test_bad_arguments_raise_naming_argument_and_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        functional(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "optimizer,reason",
    [
        (keras.optimizers.SGD(clipnorm=1.0), "clips each replica's gradient before the cross-replica all-reduce"),
        (keras.optimizers.Adam(global_clipnorm=1.0), "clips each replica's gradient before the cross-replica all-reduce"),
        (keras.optimizers.SGD(clipvalue=0.5), "clips each replica's gradient before the cross-replica all-reduce"),
        (keras.optimizers.SGD(gradient_accumulation_steps=2), "crashes under MirroredStrategy"),
        (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(clipnorm=1.0)), "clipnorm=1.0"),
    ],
)
def test_compile_rejects_optimizer_side_clipping_and_accumulation(optimizer, reason):
    model = functional()
    with pytest.raises(ValueError) as error:
        model.compile(optimizer=optimizer, loss="mse")
    assert reason in str(error.value)
    assert "to SafeDistributedModel(...) instead" in str(error.value)


@pytest.mark.parametrize("name, value, message", [
    ("clipnorm", -1.0, "`clipnorm` must be a finite number > 0 or None. Received: clipnorm=-1.0"),
    ("gradient_accumulation_steps", 0, "`gradient_accumulation_steps` must be an integer >= 1. Received: gradient_accumulation_steps=0"),
    ("skip_nonfinite", "yes", "`skip_nonfinite` must be True or False. Received: skip_nonfinite='yes'"),
    ("log_update_stats", None, "`log_update_stats` must be True or False. Received: log_update_stats=None"),
    ("global_clipnorm", float("inf"), "`global_clipnorm` must be a finite number > 0 or None. Received: global_clipnorm=inf"),
    ("accumulation_dtype", "half", "`accumulation_dtype` must be None or one of 'bfloat16', 'float32', 'float64'. Received: accumulation_dtype='half'"),
])
def test_an_option_assigned_after_construction_is_checked_as_the_constructor_does(name, value, message):
    model = functional(gradient_accumulation_steps=2)
    before = getattr(model, name)
    with pytest.raises(ValueError) as error:
        setattr(model, name, value)
    assert str(error.value) == message
    assert getattr(model, name) == before


def test_switching_clipping_modes_needs_the_old_one_set_to_none_first():
    model = functional(clipnorm=1.0)
    with pytest.raises(ValueError) as error:
        model.global_clipnorm = 2.0
    assert str(error.value) == (
        "Only one of `global_clipnorm`, `clipnorm` and `clipvalue` can be set. "
        "Received: global_clipnorm=2.0, clipnorm=1.0, clipvalue=None. To switch to "
        "`global_clipnorm`, first set the mode in use to None (model.clipnorm = None), "
        "then assign global_clipnorm"
    )
    model.clipnorm = None
    model.global_clipnorm = 2.0
    assert (model.clipnorm, model.global_clipnorm) == (None, 2.0)


@pytest.mark.parametrize(
    "given, meant",
    [
        ("gradient_accumulation", "gradient_accumulation_steps"),
        ("accumulation_steps", "gradient_accumulation_steps"),
        ("clip_norm", "clipnorm"),
        ("global_clip_norm", "global_clipnorm"),
        ("clip_value", "clipvalue"),
        ("accumulator_dtype", "accumulation_dtype"),
        # Other libraries' names, which stock Keras would ignore too.
        ("accum_steps", "gradient_accumulation_steps"),
        ("max_grad_norm", "global_clipnorm"),
        ("skip_nan", "skip_nonfinite"),
    ],
)
def test_a_misspelled_option_is_refused_naming_the_closest(given, meant):
    inputs = keras.Input((3,))
    with pytest.raises(TypeError) as error:
        SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), **{given: 4})
    message = str(error.value)
    assert f"SafeDistributedModel got unexpected keyword arguments [{given!r}]" in message
    assert f"(did you mean {meant!r}?)" in message
    assert f"Received: {given}=4" in message


def test_a_mixed_in_parent_s_own_arguments_reach_it():
    # A KerasHub backbone takes `layer_norm_epsilon`: other libraries' option
    # names are read only by the functional constructor.
    class Base(keras.Model):
        def __init__(self, layer_norm_epsilon=1e-6, **kwargs):
            super().__init__(**kwargs)
            self.epsilon = layer_norm_epsilon
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    class SafeBase(SafeDistributedModel, Base):
        pass

    assert SafeBase(layer_norm_epsilon=1e-5, gradient_accumulation_steps=2).epsilon == 1e-5
    inputs = keras.Input((3,))
    with pytest.raises(TypeError, match=r"\['layer_norm_epsilon'\] \(did you mean 'global_clipnorm'\?\)"):
        SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), layer_norm_epsilon=1e-5)


def test_a_misspelled_option_of_a_subclass_is_refused_before_keras_sees_it():
    class Net(SafeDistributedModel):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match=r"Net got unexpected keyword arguments \['clip_norm'\] \(did you mean 'clipnorm'\?\)"):
        Net(clip_norm=1.0)


def test_keras_arguments_and_unrelated_keywords_pass_as_for_stock_keras():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    stock = keras.Model(inputs, outputs, name="net", unrelated=1)  # stock ignores it
    model = SafeDistributedModel(inputs, outputs, name="net", trainable=True, unrelated=1)
    assert (model.name, model.gradient_accumulation_steps) == (stock.name, 1)
