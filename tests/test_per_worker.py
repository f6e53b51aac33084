"""Per-worker data under MultiWorkerMirroredStrategy: each worker reads its own rows.

The multi-worker tests start two real workers on 127.0.0.1 (mw_per_worker.py);
the rest runs in this process.
"""

import json
import math
import pathlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.backend.tensorflow import _compat as _tf_compat
from keras_safe_dist.backend.tensorflow import _per_worker
from keras_safe_dist.scale_out.launch import WorkerGroup

from conftest import relative_error
from conftest import strategy_for

# Per-worker data trains exactly from Keras 3.15; earlier releases refuse it
# (test_per_worker_data_is_refused_where_keras_trains_it_on_other_batches).
_needs_exact_keras = pytest.mark.skipif(
    not _tf_compat.PER_WORKER_DATA_EXACT,
    reason=f"Keras {keras.__version__} refuses per-worker data (it trains on other batches)",
)


@pytest.fixture(autouse=True)
def _per_worker_logic_on_any_keras(monkeypatch):
    """The in-process tests check the detection and the rewriting on every Keras."""
    monkeypatch.setattr(_tf_compat, "PER_WORKER_DATA_EXACT", True)


def test_per_worker_data_is_refused_where_keras_trains_it_on_other_batches(monkeypatch):
    monkeypatch.setattr(_tf_compat, "PER_WORKER_DATA_EXACT", False)
    monkeypatch.setattr(_per_worker, "_workers", lambda strategy: 2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.range(4).batch(2).with_options(options)
    strategy = strategy_for(2)
    for data in (dataset, strategy.distribute_datasets_from_function(lambda _: dataset)):
        with pytest.raises(ValueError) as error:
            _per_worker.is_per_worker(strategy, data)
        assert (
            "Under MultiWorkerMirroredStrategy SafeDistributedModel trains on such data exactly "
            f"with Keras 3.15 or later; on Keras {keras.__version__} it would train on other "
            "batches than one device does."
        ) in str(error.value)
    # Data TensorFlow shards across the workers is not refused.
    assert not _per_worker.is_per_worker(strategy, tf.data.Dataset.range(4).batch(2))

WORKER = str(pathlib.Path(__file__).resolve().parent / "mw_per_worker.py")
TIMEOUT = 240  # seconds; a hung collective fails the test instead of CI
PER_REPLICA = 4  # mw_per_worker.GLOBAL_BATCH over 2 workers


def data(n0, n1, seed):
    """mw_per_worker.data: worker 0 holds the first n0 rows, worker 1 the next n1."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n0 + n1, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")
    return x, y


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def step_batches(n0, n1, seed):
    """Each step's union of the workers' batches: worker 0's rows, then worker 1's."""
    x, y = data(n0, n1, seed)
    own = [(x[:n0], y[:n0]), (x[n0:], y[n0:])]
    steps = max(math.ceil(n0 / PER_REPLICA), math.ceil(n1 / PER_REPLICA))
    rows = [slice(i * PER_REPLICA, (i + 1) * PER_REPLICA) for i in range(steps)]
    return [tuple(np.concatenate([part[k][r] for part in own]) for k in (0, 1)) for r in rows]


def one_device_run(train, val, steps, epochs):
    """Stock Keras on one device: one batch per update, each the union of `steps` steps."""
    model = build()
    batches = step_batches(*train, seed=0)
    val_x, val_y = data(*val, seed=1)
    history = {"loss": [], "val_loss": [], "val_mae": []}
    for _ in range(epochs):
        seen = total = 0.0
        for g in range(0, len(batches), steps):
            x, y = (np.concatenate(part) for part in zip(*batches[g:g + steps]))
            total += model.train_on_batch(x, y, return_dict=True)["loss"] * len(x)
            seen += len(x)
        history["loss"].append(total / seen)
        logs = model.evaluate(val_x, val_y, batch_size=len(val_x), verbose=0, return_dict=True)
        history["val_loss"].append(logs["loss"])
        history["val_mae"].append(logs["mae"])
    return model, history


def run_workers(args):
    lines = []
    group = WorkerGroup(WORKER, workers=2, args=args, on_line=lambda i, line: lines.append((i, line)))
    codes = group.start().wait(TIMEOUT)
    results = {i: json.loads(line[len("RESULT "):]) for i, line in lines if line.startswith("RESULT ")}
    return codes, results, lines


def relative(expected, actual):
    return max(abs(e - a) / max(abs(e), 1e-6) for e, a in zip(expected, actual))


def check_against_one_device(results, train, val, test, steps, epochs=2):
    """Both workers hold the one-device weights, logs and evaluation; returns the worst error."""
    reference, history = one_device_run(train, val, steps, epochs)
    worst = 0.0
    for index in (0, 1):
        result = results[index]
        trained = [np.array(w, "float32") for w in result["weights"]]
        worst = max(worst, relative_error(reference.get_weights(), trained))
        for name, values in history.items():
            worst = max(worst, relative(values, result["history"][name]))
        # evaluate(): each sample of both workers counted once.
        reference.set_weights(trained)
        x, y = data(*test, seed=2)
        logs = reference.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
        worst = max(worst, relative([logs["loss"], logs["mae"]],
                                    [result["evaluate"]["loss"], result["evaluate"]["mae"]]))
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["history"] == results[1]["history"]
    return worst


@pytest.mark.processes
@_needs_exact_keras
def test_equal_per_worker_datasets_without_sharding_train_every_batch_exactly():
    # 32 rows a worker in global batches of 8: 8 steps of 4 + 4 rows an epoch,
    # where Keras read 4 (the batches before TensorFlow splits them) and
    # trained on the first half of each epoch only. Validation and evaluation
    # on uneven per-worker data: 12/17 and 13/20 rows.
    codes, results, lines = run_workers(
        ["--input", "off", "--train", "32/32", "--val", "12/17", "--test", "13/20"]
    )
    assert codes == [0, 0], [line for _, line in lines][-20:]
    assert results[0]["iterations"] == results[1]["iterations"] == 16
    assert check_against_one_device(results, (32, 32), (12, 17), (13, 20), steps=1) < 1e-5
    assert not [line for _, line in lines if _tf_compat.RAN_OUT_OF_DATA in line]


@pytest.mark.processes
@_needs_exact_keras
def test_uneven_per_worker_datasets_from_a_function_accumulate_exactly():
    # 32 and 33 rows: 9 steps an epoch, the last only worker 1's row; with
    # gradient_accumulation_steps=2 the 5th update of each epoch is the
    # partial group of that one step (this hung before).
    codes, results, lines = run_workers(
        ["--input", "dff", "--train", "32/33", "--val", "9/14", "--test", "30/35", "--steps", "2",
         "--predict", "--repeat-on-chief"]
    )
    assert codes == [0, 0], [line for _, line in lines][-20:]
    assert results[0]["iterations"] == results[1]["iterations"] == 10
    assert check_against_one_device(results, (32, 33), (9, 14), (30, 35), steps=2) < 1e-5
    # predict(): every worker gets the 65 predictions, each step's union in turn.
    model = build()
    model.set_weights([np.array(w, "float32") for w in results[0]["weights"]])
    x = np.concatenate([batch[0] for batch in step_batches(30, 35, seed=2)])
    expected = model.predict(x, verbose=0)
    for index in (0, 1):
        assert relative_error([expected], [np.array(results[index]["predict"], "float32")]) < 1e-6
    # Data that repeats forever on worker 0 only: the same clear error on both workers.
    for index, received in ((0, "cardinality -1 (infinite)"), (1, "cardinality 9 (ends)")):
        message = results[index]["repeat_on_chief"]
        assert message.startswith(
            "SafeDistributedModel.evaluate() received a per-worker `x` (each worker reads its "
            "own) that repeats forever on some workers and ends on the others (1 of the 2 "
            "replicas repeat it)"
        ), message
        assert f"Received on this worker: {received}." in message
        assert message.endswith("or repeat it on every worker and pass `steps`.")


def test_one_worker_and_default_sharding_keep_keras_own_arguments():
    off = tf.data.Options()
    off.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensor_slices(np.ones((8, 2), "float32")).batch(4)
    args, kwargs = (dataset.with_options(off),), {"epochs": 2}
    # One worker (MirroredStrategy, the default strategy): nothing to change.
    for replicas in (1, 2):
        strategy = strategy_for(replicas)
        assert not _per_worker.is_per_worker(strategy, dataset.with_options(off))
        assert _per_worker.fit_arguments(strategy, args, kwargs) == (args, kwargs)
        assert _per_worker.evaluate_arguments(strategy, args, kwargs) == (args, kwargs)


@pytest.mark.parametrize(
    "policy, per_worker",
    [("OFF", True), ("FILE", True), ("HINT", True), ("AUTO", False), ("DATA", False)],
)
def test_auto_shard_policies_that_leave_each_worker_its_own_data_are_per_worker(
    monkeypatch, policy, per_worker
):
    monkeypatch.setattr(_per_worker, "_workers", lambda strategy: 2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy
    )
    dataset = tf.data.Dataset.range(4).batch(2).with_options(options)
    strategy = strategy_for(2)
    assert _per_worker.is_per_worker(strategy, dataset) is per_worker
    distributed = strategy.experimental_distribute_dataset(dataset)
    assert _per_worker.is_per_worker(strategy, distributed) is per_worker
    from_function = strategy.distribute_datasets_from_function(lambda _: dataset)
    assert _per_worker.is_per_worker(strategy, from_function)
    assert not _per_worker.is_per_worker(strategy, np.ones((4, 2)))


def test_per_worker_data_is_handed_to_keras_with_an_unknown_length(monkeypatch):
    monkeypatch.setattr(_per_worker, "_workers", lambda strategy: 2)
    monkeypatch.setattr(_per_worker, "check_ends_agree", lambda *args: None)
    off = tf.data.Options()
    off.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 2), "float32"), np.ones((8, 1), "float32"))
    ).batch(4).with_options(off)
    strategy = strategy_for(2)
    args, kwargs = _per_worker.fit_arguments(
        strategy, (dataset,), {"validation_data": dataset, "shuffle": False}
    )
    for adapter in (args[0], kwargs["validation_data"]):
        assert isinstance(adapter, _tf_compat.UnknownLengthAdapter)
        assert adapter.num_batches is None and adapter.get_tf_dataset() is dataset
    assert kwargs["shuffle"] is False
    # A number of steps given is kept, and so is the data.
    args, kwargs = _per_worker.fit_arguments(strategy, (dataset,), {"steps_per_epoch": 3})
    assert args == (dataset,) and kwargs == {"steps_per_epoch": 3}
    args, kwargs = _per_worker.evaluate_arguments(strategy, (), {"x": dataset, "verbose": 0})
    assert isinstance(args[0], _tf_compat.UnknownLengthAdapter) and kwargs == {"verbose": 0}
    # Keras's own checks still run: a dataset with `y` is refused as stock refuses it.
    with pytest.raises(ValueError, match="`y` should not be passed"):
        _per_worker.evaluate_arguments(strategy, (dataset, np.ones(8)), {})


def test_keras_end_of_data_warning_is_silenced_only_for_per_worker_adapters():
    adapter = _tf_compat.UnknownLengthAdapter(
        _tf_compat.data_adapter(np.ones((4, 2)), None, None, 2, False, None)
    )
    for args, expected in (((adapter,), 0), ((np.ones(2),), 1)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _per_worker.epoch_ends_expected(args, {}):
                warnings.warn(_tf_compat.RAN_OUT_OF_DATA + ".", UserWarning, stacklevel=2)
        assert len(caught) == expected


def test_safe_model_trains_on_one_worker_as_before_with_per_worker_options():
    # Under MirroredStrategy (one worker) an OFF dataset is distributed as stock does.
    off = tf.data.Options()
    off.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    x, y = data(10, 0, seed=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).with_options(off)
    with strategy_for(2).scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    class Steps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps = self.params["steps"]

    steps = Steps()
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[steps])
    assert steps.steps == 3
