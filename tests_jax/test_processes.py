"""Several JAX processes, each feeding its own shard: exact, and never a hang.

Each run starts real processes on 127.0.0.1 (tests_jax/processes/shards.py)
with hard timeouts; the reference is stock Keras on one device trained on
the same global batches (process 0's rows of each step, then process 1's...).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_safe_dist.scale_out import launch

SCRIPT = os.path.join(os.path.dirname(__file__), "processes", "shards.py")
TIMEOUT = 20  # keras_safe_dist.initialize(timeout=...) in the failure tests
HARD = 150  # no run of these tests may take longer


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_DISTRIBUTION_", "SLURM_"))}
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _start(out, sizes, *options, environments):
    processes = []
    for index, extra in enumerate(environments):
        log = open(os.path.join(out, f"log_{index}.txt"), "wb")
        processes.append(subprocess.Popen(
            [sys.executable, SCRIPT, str(out), sizes, *options],
            env=_env(extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))
    return processes


def _wait(processes, limit=HARD):
    """Exit codes and end times; kills every process group left after `limit` seconds."""
    deadline = time.monotonic() + limit
    ends = [None] * len(processes)
    while any(end is None for end in ends) and time.monotonic() < deadline:
        for i, process in enumerate(processes):
            if ends[i] is None and process.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return [p.returncode for p in processes], ends


def _run(out, sizes, *options):
    count = len(sizes.split(","))
    ports = launch.free_ports(count)
    processes = _start(out, sizes, *options, environments=[launch.jax_env(ports, i) for i in range(count)])
    codes, _ = _wait(processes)
    logs = [_log(out, i) for i in range(count)]
    assert codes == [0] * count, logs
    return logs


def _reference(out, sizes, *options):
    subprocess.run(
        [sys.executable, SCRIPT, str(out), sizes, "--reference", *options],
        env=_env(), check=True, timeout=HARD, capture_output=True,
    )
    return np.load(os.path.join(out, "reference.npz"))


def _log(out, index):
    with open(os.path.join(out, f"log_{index}.txt"), "rb") as f:
        return f.read().decode("utf-8", "replace")


def _relative(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def _assert_exact(out, sizes, reference):
    count = len(sizes.split(","))
    weights = [k for k in reference.files if k.startswith("arr_")]
    offset = 0
    for process in range(count):
        got = np.load(os.path.join(out, f"process_{process}.npz"))
        for key in weights:
            assert _relative(got[key], reference[key]) <= 1e-5, (process, key)
        assert _relative(got["evaluation"], reference["evaluation"]) <= 1e-5
        rows = int(sizes.split(",")[process])
        assert got["predictions"].shape[0] == rows  # its own rows, in order
        expected = reference["predictions"][offset : offset + rows]
        if rows:
            assert _relative(got["predictions"], expected) <= 1e-5
        offset += rows


@pytest.mark.parametrize(
    "sizes, accumulation",
    [("32,33", 2), ("30,31,35", 1), ("30,0,35", 1)],
    ids=["2processes-32-33-accumulation", "3processes-30-31-35-batchnorm", "3processes-one-empty"],
)
@pytest.mark.processes
def test_any_shard_sizes_match_one_device_on_the_global_batches(tmp_path, sizes, accumulation):
    options = ("--accumulation", str(accumulation))
    reference = _reference(tmp_path, sizes, *options)
    _run(tmp_path, sizes, *options)
    _assert_exact(tmp_path, sizes, reference)


@pytest.mark.processes
def test_a_dataset_of_unknown_batch_sizes_agrees_at_each_step(tmp_path):
    reference = _reference(tmp_path, "32,33")
    logs = _run(tmp_path, "32,33", "--pydataset")
    _assert_exact(tmp_path, "32,33", reference)
    # Its batches fill the same aligned arrays again (shards.py's `Batches`):
    # with each batch's copy left out, the weights were 0.12 off.
    # The shards end where the processes agreed: nothing was interrupted
    # (before, a process printed Keras's "Your input ran out of data").
    for log in logs:
        assert "ran out of data" not in log, log[-3000:]


@pytest.mark.processes
def test_no_samples_on_any_process_is_one_clear_error_everywhere(tmp_path):
    ports = launch.free_ports(2)
    processes = _start(tmp_path, "0,0", environments=[launch.jax_env(ports, i) for i in range(2)])
    codes, _ = _wait(processes)
    assert codes == [1, 1]
    for index in range(2):
        assert "No process has samples: each of the 2 processes received data that holds none" in _log(tmp_path, index)


def _failure(out, option, limit=HARD):
    ports = launch.free_ports(2)
    processes = _start(
        out, "32,33", option, "1:2", "--timeout", str(TIMEOUT),
        environments=[launch.jax_env(ports, i) for i in range(2)],
    )
    codes, ends = _wait(processes, limit)
    log = _log(out, 1)
    failed_at = float(log.split("process 1 fails at step 2: ")[1].split()[0])
    return codes, [end - failed_at for end in ends]


@pytest.mark.processes
def test_a_process_that_raises_ends_every_process_naming_it(tmp_path):
    codes, after = _failure(tmp_path, "--fail")
    assert codes == [1, 1]
    assert max(after) < TIMEOUT
    assert "RuntimeError: process 1 fails at step 2" in _log(tmp_path, 1)
    assert (
        "keras_safe_dist: process 1: RuntimeError: process 1 fails at step 2. "
        "Ending process 0 too (exit status 1)"
    ) in _log(tmp_path, 0)


@pytest.mark.processes
@pytest.mark.parametrize(
    "option, signal_",
    # SIGTERM, before: jax's preemption service took it and the run trained
    # to its end, rc 0.
    [("--die", signal.SIGKILL), ("--term", signal.SIGTERM)],
    ids=["SIGKILL", "SIGTERM"],
)
def test_a_killed_process_ends_every_other_within_the_bound_naming_it(tmp_path, option, signal_):
    codes, after = _failure(tmp_path, option)
    assert codes[1] == -signal_
    assert codes[0] != 0
    assert after[0] < TIMEOUT + 5
    assert "process 1: stopped answering (killed or exited)" in _log(tmp_path, 0)


@pytest.mark.processes
def test_a_coordinator_that_is_not_running_is_a_clear_error_within_the_timeout(tmp_path):
    ports = launch.free_ports(2)
    started = time.time()
    processes = _start(
        tmp_path, "32,33", "--timeout", "10", environments=[launch.jax_env(ports, 1)]
    )
    codes, ends = _wait(processes, 60)
    assert codes == [1]
    assert ends[0] - started < 10 + 15  # the timeout, and Python's start-up
    assert (
        f"Process 1 could not reach the coordinator (process 0) at '127.0.0.1:{ports[0]}' within 10 s"
    ) in _log(tmp_path, 0)


def _free_slurm_port():
    """A free port in the range jax derives Slurm's coordinator port from (61440-65535)."""
    for port in range(65535 - 2**12 + 1, 65536):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 61440-65535")


@pytest.mark.processes
def test_a_slurm_environment_needs_no_launcher(tmp_path):
    port = _free_slurm_port()
    slurm = {
        "SLURM_JOB_ID": str(port - (65535 - 2**12 + 1)),  # jax: port = 61440 + job id % 4096
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": "2",
    }
    environments = [dict(slurm, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) for i in range(2)]
    reference = _reference(tmp_path, "32,33")
    codes, _ = _wait(_start(tmp_path, "32,33", environments=environments))
    assert codes == [0, 0], [_log(tmp_path, i) for i in range(2)]
    _assert_exact(tmp_path, "32,33", reference)


@pytest.mark.processes
def test_a_killed_run_resumes_from_its_backup_to_the_uninterrupted_weights(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    full.mkdir(), cut.mkdir()
    options = ("--accumulation", "2", "--timeout", str(TIMEOUT))
    _run(full, "32,33", *options)
    backup = str(tmp_path / "backup")
    ports = launch.free_ports(2)
    killed = _start(
        cut, "32,33", *options, "--backup", backup, "--die", "1:2:1",  # epoch 2, step 3
        environments=[launch.jax_env(ports, i) for i in range(2)],
    )
    codes, _ = _wait(killed)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    # Process 0's backup of epoch 1 (its lock is stale: a dead process held it).
    kept = sorted(name for name in os.listdir(backup) if not name.endswith(".lock"))
    assert kept == ["epoch_1.weights.h5", "process_1", "training_metadata.json"]
    _run(cut, "32,33", *options, "--backup", backup)  # the same command again
    assert not os.path.exists(backup)  # removed once training ended
    for process in range(2):
        resumed = np.load(cut / f"process_{process}.npz")
        uninterrupted = np.load(full / f"process_{process}.npz")
        for key in uninterrupted.files:
            np.testing.assert_allclose(resumed[key], uninterrupted[key], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kwargs, environment, message",
    [
        ({"timeout": 5}, {}, "`timeout` must be an integer >= 10 (seconds). Received: timeout=5"),
        ({"num_processes": 2, "process_id": 2}, {}, "`process_id` must be in [0, num_processes - 1] = [0, 1]. Received: process_id=2"),
        ({}, {"KERAS_DISTRIBUTION_PROCESS_ID": "one"}, "`process_id` must be an integer >= 0. Received: KERAS_DISTRIBUTION_PROCESS_ID='one'"),
        # Before: a C++ check failure after about 20 s.
        ({"coordinator_address": "127.0.0.1:0", "num_processes": 2, "process_id": 0}, {},
         "The coordinator address must be 'host:port' with a port from 1 to 65535, the port "
         "process 0 listens on. Received: '127.0.0.1:0'."),
    ],
)
def test_initialize_refuses_bad_settings_before_joining(monkeypatch, kwargs, environment, message):
    import keras_safe_dist

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        keras_safe_dist.initialize(**kwargs)
    assert message in str(error.value)


@pytest.mark.processes
def test_nan_onset_names_the_process_and_the_row_of_its_local_batch(tmp_path):
    # Row 13 of process 1's data: its second batch of 8, row 5 there; row 13
    # of the global batch (process 0's 8 rows come first).
    _run(tmp_path, "32,33", "--nan", "1:13")
    with open(tmp_path / "nan" / "nan_onset.json") as f:
        report = json.load(f)
    assert (report["epoch"], report["batch"], report["kind"]) == (0, 1, "inputs")
    assert report["rows"] == [13]
    assert report["process_rows"] == [[1, 5]]
    assert "NaN onset at epoch 0, batch 1, sample rows 13 (process 1 row 5 of its local batch)" in _log(tmp_path, 0)
    batch = np.load(tmp_path / "nan" / "nan_onset_batch.npz")["x"]  # the global batch, written by process 0
    assert batch.shape == (16, 6)
    assert np.isnan(batch[13, 0]) and np.isfinite(np.delete(batch, 13, axis=0)).all()


def _mlp():
    import keras

    from keras_safe_dist import SafeDistributedModel

    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_process_started_as_one_of_several_but_alone_is_refused(monkeypatch):
    # What `keras-safe-dist launch --backend jax` sets, without initialize():
    # before, each worker trained as "process 0 of 1" on the same rows, rc 0.
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    model = _mlp()
    x = np.ones((8, 4), "float32")
    with pytest.raises(RuntimeError) as error:
        model.fit(x, x[:, :1], verbose=0)
    assert str(error.value) == (
        "fit() runs in one process, but this process was started as one of 2 "
        "(KERAS_DISTRIBUTION_NUM_PROCESSES=2, KERAS_DISTRIBUTION_PROCESS_ID='1'): jax was "
        "never told of the others, so each process would train alone on the same data. Call "
        "keras_safe_dist.initialize() first thing in the script, before building the model."
    )
    assert int(model.optimizer.iterations.value) == 0
    with pytest.raises(RuntimeError, match=r"^evaluate\(\) runs in one process"):
        model.evaluate(x, x[:, :1], verbose=0)


@pytest.mark.parametrize("devices", [None, "local"], ids=["no_distribution", "local_devices"])
def test_several_processes_without_a_distribution_over_them_are_refused(monkeypatch, devices):
    import jax
    import keras

    # Before: each process fitted its own model on its own rows, rc 0, and
    # the processes' weights ended 0.10 to 0.22 apart.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    if devices == "local":
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = _mlp()
    x = np.ones((8, 4), "float32")
    with pytest.raises(ValueError) as error:
        model.fit(x, x[:, :1], verbose=0)
    received = "no distribution" if devices is None else "DataParallel over the devices of 1 of them"
    assert str(error.value) == (
        f"fit() with 2 processes needs a keras.distribution over the devices of every process; "
        f"received: {received}. Without one each process would fit its own model on its own "
        "rows. Call keras.distribution.set_distribution(keras.distribution.DataParallel()) "
        "after keras_safe_dist.initialize() and before building the model."
    )


@pytest.mark.processes
def test_a_launched_script_that_never_joins_fails_on_every_worker(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(
        "import keras, numpy as np\n"
        "from keras_safe_dist import SafeDistributedModel\n"
        "inputs = keras.Input((4,))\n"
        "model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))\n"
        "model.compile(optimizer='sgd', loss='mse')\n"
        "model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist.cli", "launch", "--backend", "jax",
         "--workers", "2", "--timeout", "120", str(script)],
        env=_env(), capture_output=True, text=True, timeout=HARD,
    )
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert output.count("but this process was started as one of 2") == 2, output[-3000:]


@pytest.mark.processes
def test_processes_running_different_programs_are_named_before_the_first_step(tmp_path):
    # Before: gloo's "collective mismatch" and SIGABRT after 10 to 22 s.
    ports = launch.free_ports(2)
    processes = _start(tmp_path, "32,33", "--epochs-on", "1:2", "--timeout", str(TIMEOUT),
                       environments=[launch.jax_env(ports, i) for i in range(2)])
    codes, _ = _wait(processes)
    assert codes == [1, 1]
    for index in range(2):
        assert (
            "ValueError: The 2 processes do not run the same program: process 0: fit() for 3 "
            "epochs of a model of 6 trainable variables, 178 values; process 1: fit() for 2 "
            "epochs of a model of 6 trainable variables, 178 values. Every process must call "
            "the same methods with the same epochs on the same model"
        ) in _log(tmp_path, index)


@pytest.mark.processes
def test_a_process_that_ends_its_script_early_ends_every_process_naming_it(tmp_path):
    # Before: jax's "Barrier timed out" and SIGABRT in both, after the timeout.
    ports = launch.free_ports(2)
    started = time.time()
    processes = _start(tmp_path, "32,33", "--end-after-fit", "1", "--timeout", str(TIMEOUT),
                       environments=[launch.jax_env(ports, i) for i in range(2)])
    codes, ends = _wait(processes)
    assert codes == [1, 1]
    # Python's and jax's start-up included: 20 s alone on a quiet 2-core machine, and
    # up to 41 s there beside the other pytest worker; a wait for good never ends.
    assert max(ends) - started < TIMEOUT + 30
    text = (
        "keras_safe_dist: process 1: ended its script after 1 fit(), evaluate() or predict() "
        "calls while process 0 started evaluate() (its call 2), which would wait for process 1 "
        "in a collective for good. Every process must make the same calls, in the same order"
    )
    assert f"{text}. Exit status 1." in _log(tmp_path, 1)
    assert f"{text}. Ending process 0 too (exit status 1)" in _log(tmp_path, 0)
    assert "Barrier timed out" not in _log(tmp_path, 0) + _log(tmp_path, 1)


_JOIN = "import keras_safe_dist; print(keras_safe_dist.initialize(timeout=10), flush=True)"


def _join(environments):
    """Processes that only join; `(exit codes, outputs, seconds)`."""
    started = time.monotonic()
    processes = [
        subprocess.Popen([sys.executable, "-c", _JOIN], env=_env(extra), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for extra in environments
    ]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=HARD)[0])
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            outputs.append(process.communicate()[0])
    return [p.returncode for p in processes], outputs, time.monotonic() - started


@pytest.mark.processes
def test_a_process_count_above_the_processes_started_is_named_within_the_timeout():
    # Before: jax's "RegisterTask" check failure and SIGABRT.
    ports = launch.free_ports(2)
    codes, outputs, seconds = _join([launch.jax_env(ports, 0)])
    assert codes == [1]
    assert seconds < 10 + 15  # the timeout, and Python's start-up
    assert (
        f"keras_safe_dist: process 0 could not join the run at '127.0.0.1:{ports[0]}' within 10 s: "
        "not all of its 2 processes registered. Start exactly 2 processes "
        "(KERAS_DISTRIBUTION_NUM_PROCESSES), each with its own process id from 0 to 1"
    ) in outputs[0]
    assert "Check failure" not in outputs[0]


@pytest.mark.processes
def test_two_processes_with_one_process_id_on_a_machine_are_named():
    # Before: jax's "RegisterTask" check failure and SIGABRT in every process.
    ports = launch.free_ports(2)
    environments = [launch.jax_env(ports, 0), launch.jax_env(ports, 1), launch.jax_env(ports, 1)]
    codes, outputs, _ = _join(environments)
    # The first of the two to start joins; the other is refused at once.
    assert codes[0] == 0 and sorted(codes[1:]) == [0, 1], outputs
    refused = outputs[1 + codes[1:].index(1)]
    assert (
        f"RuntimeError: Another process on this machine already joined the run at "
        f"'127.0.0.1:{ports[0]}' as process_id=1 of 2. Every process needs a process id of its "
        "own"
    ) in refused
    assert "(0, 2)" in outputs[0]


MODEL_PARALLEL = os.path.join(os.path.dirname(__file__), "processes", "model_parallel.py")


def _model_parallel(out, mesh):
    ports = launch.free_ports(2)
    processes = []
    for index in range(2):
        extra = dict(launch.jax_env(ports, index), XLA_FLAGS="--xla_force_host_platform_device_count=2")
        log = open(os.path.join(out, f"log_{index}.txt"), "wb")
        processes.append(subprocess.Popen(
            [sys.executable, MODEL_PARALLEL, str(out), mesh], env=_env(extra), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        ))
    codes, _ = _wait(processes)
    return codes, [_log(out, i) for i in range(2)]


@pytest.mark.processes
def test_model_parallel_over_two_processes_is_exact_with_sharded_accumulators(tmp_path):
    sys.path.insert(0, os.path.dirname(MODEL_PARALLEL))
    import keras
    import model_parallel as worker

    # The batch axis over the 2 processes, the model axis over each one's 2 devices.
    codes, logs = _model_parallel(tmp_path, "2,2")
    assert codes == [0, 0], logs
    # Stock Keras on one device, one update per 2 global batches of 8 + 8 rows
    # (each step: process 0's 8 rows, then process 1's).
    x, y = worker.data()
    stock = worker.build(keras.Model)
    stock.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=worker.CLIP), loss="mse")
    rows = [np.arange(p * 32, (p + 1) * 32).reshape(4, 8) for p in range(2)]
    for _ in range(worker.EPOCHS):
        for group in range(2):
            update = np.concatenate([rows[p][2 * group + k] for k in range(2) for p in range(2)])
            stock.train_on_batch(x[update], y[update])
    reference = np.concatenate([w.ravel() for w in stock.get_weights()])
    for index in range(2):
        saved = np.load(tmp_path / f"process_{index}.npz")
        trained = np.concatenate([saved[f"arr_{i}"].ravel() for i in range(4)])
        assert np.linalg.norm(trained - reference) / np.linalg.norm(reference) < 1e-5
        assert saved["laid_out"].tolist() == [True] * 4


@pytest.mark.processes
def test_a_mesh_whose_batch_axis_misses_a_process_is_named(tmp_path):
    # Before: ZeroDivisionError inside the data placement.
    codes, logs = _model_parallel(tmp_path, "1,4")
    assert codes == [1, 1]
    assert (
        "ValueError: The distribution splits the batch into 1 part(s) over 2 processes: "
        "processes would share a part of the batch, and each passes its own rows. Lay the "
        "batch axis of the device mesh over every process"
    ) in logs[0] + logs[1]


def test_a_coordinator_port_held_by_another_program_is_named():
    import keras_safe_dist

    # Before: a segmentation fault (rc 139) or "Failed to start RPC server".
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError) as error:
            keras_safe_dist.initialize(
                coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=0, timeout=10
            )
    assert str(error.value) == (
        f"Process 0 cannot host the coordinator at '127.0.0.1:{port}': port {port} is in use by "
        "another program. Choose a free port for the first address of "
        "KERAS_DISTRIBUTION_JOB_ADDRESSES (or coordinator_address), or stop the program that "
        "holds it."
    )


def test_initialize_called_twice_is_named(tmp_path):
    # Before: a C++ check failure after about 20 s.
    port = launch.free_ports(1)[0]
    script = (
        "import keras_safe_dist\n"
        f"keras_safe_dist.initialize('127.0.0.1:{port}', num_processes=1, process_id=0, timeout=10)\n"
        "try:\n"
        f"    keras_safe_dist.initialize('127.0.0.1:{port}', num_processes=1, process_id=0, timeout=10)\n"
        "except RuntimeError as error:\n"
        "    print('RuntimeError:', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True,
                          text=True, timeout=HARD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "RuntimeError: keras_safe_dist.initialize() was called twice in this process (or after "
        "jax.distributed.initialize()): it already runs as process 0 of 1. Call it once, first "
        "thing in the script."
    ) in done.stdout


def test_initialize_with_no_coordinator_anywhere_says_how_to_start_the_processes():
    # Before: "could not join the run within 60 s: coordinator None, None processes".
    env = {k: v for k, v in _env().items() if not k.startswith(("KERAS_DISTRIBUTION_", "SLURM_", "OMPI_"))}
    script = (
        "import keras_safe_dist\n"
        "try:\n"
        "    keras_safe_dist.initialize(timeout=10)\n"
        "except ValueError as error:\n"
        "    print('ValueError:', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HARD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "ValueError: keras_safe_dist.initialize() found no coordinator: the script ran without "
        "KERAS_DISTRIBUTION_JOB_ADDRESSES, KERAS_DISTRIBUTION_NUM_PROCESSES and "
        "KERAS_DISTRIBUTION_PROCESS_ID, no arguments, and jax detected no cluster"
    ) in done.stdout
    assert "keras-safe-dist launch --backend jax --workers N script.py" in done.stdout
