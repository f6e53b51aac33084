"""`keras-safe-dist launch`: ports, TF_CONFIG, prefixed output, failure and timeout handling."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from keras_safe_dist import cli
from keras_safe_dist import is_chief
from keras_safe_dist.scale_out import _cluster
from keras_safe_dist.scale_out.launch import WorkerGroup
from keras_safe_dist.scale_out.launch import free_ports
from keras_safe_dist.scale_out.launch import tf_config

from conftest import strategy_for


def script(tmp_path, body):
    path = tmp_path / "worker.py"
    path.write_text("import json, os, sys, time\nindex = json.loads(os.environ['TF_CONFIG'])['task']['index']\n" + body)
    return str(path)


def test_free_ports_are_distinct_and_tf_config_names_loopback_only():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    config = json.loads(tf_config(ports, 2))
    assert config["cluster"]["worker"] == [f"127.0.0.1:{p}" for p in ports]
    assert config["task"] == {"type": "worker", "index": 2}


def test_jax_backend_gives_each_process_kerass_variables_and_gloo(tmp_path, capsys):
    path = tmp_path / "process.py"
    path.write_text(
        "import os\n"
        "names = ['KERAS_BACKEND', 'KERAS_DISTRIBUTION_JOB_ADDRESSES', 'KERAS_DISTRIBUTION_NUM_PROCESSES',\n"
        "         'KERAS_DISTRIBUTION_PROCESS_ID', 'JAX_CPU_COLLECTIVES_IMPLEMENTATION', 'TF_CONFIG']\n"
        "print(' '.join(f'{n}={os.environ.get(n)}' for n in names))\n"
    )
    assert cli.main(["launch", "--backend", "jax", "--workers", "2", str(path)]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    addresses = lines[0].split("KERAS_DISTRIBUTION_JOB_ADDRESSES=")[1].split()[0]
    assert [a.split(":")[0] for a in addresses.split(",")] == ["127.0.0.1", "127.0.0.1"]
    for index, line in enumerate(lines):
        assert line == (
            f"[worker {index}] KERAS_BACKEND=jax KERAS_DISTRIBUTION_JOB_ADDRESSES={addresses} "
            f"KERAS_DISTRIBUTION_NUM_PROCESSES=2 KERAS_DISTRIBUTION_PROCESS_ID={index} "
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo TF_CONFIG=None"
        )


def test_an_unknown_backend_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", "--backend", "torch", "x.py"])
    assert exit_info.value.code == 2
    assert "argument --backend: invalid choice: 'torch' (choose from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`backend` must be one of 'tensorflow', 'jax'. Received: backend='torch'"):
        WorkerGroup(str(tmp_path), backend="torch")


def test_initialize_on_tensorflow_points_to_multi_worker_mirrored_strategy():
    import keras_safe_dist

    with pytest.raises(ValueError, match="use `tf.distribute.MultiWorkerMirroredStrategy\\(\\)` with a `TF_CONFIG` instead"):
        keras_safe_dist.initialize()


def test_launch_prefixes_each_workers_output(tmp_path, capsys):
    path = script(tmp_path, "print(f'hello from {index}')\n")
    assert cli.main(["launch", "--workers", "3", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[worker 0] hello from 0", "[worker 1] hello from 1", "[worker 2] hello from 2"]


def test_launch_passes_script_arguments(tmp_path, capsys):
    path = script(tmp_path, "print(sys.argv[1:])\n")
    assert cli.main(["launch", "--workers", "1", path, "--flag", "7"]) == 0
    assert capsys.readouterr().out.strip() == "[worker 0] ['--flag', '7']"


def test_one_failing_worker_kills_the_group(tmp_path, capsys):
    path = script(tmp_path, "if index == 1:\n    sys.exit(3)\ntime.sleep(60)\n")
    assert cli.main(["launch", "--workers", "2", "--timeout", "30", path]) == 3
    assert "worker 1 exited with status 3; killed the other workers." in capsys.readouterr().err


def test_timeout_kills_the_group(tmp_path, capsys):
    path = script(tmp_path, "time.sleep(60)\n")
    assert cli.main(["launch", "--workers", "2", "--timeout", "1", path]) == 124
    assert "Workers still running after 1 s; killed them." in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["launch", "--workers", "0", "x.py"], "argument --workers: expected an integer >= 1, received '0'"),
    (["launch", "--timeout", "soon", "x.py"], "argument --timeout: expected an integer >= 1, received 'soon'"),
    (["launch"], "the following arguments are required: script"),
])
def test_bad_arguments_exit_2_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_exits_2(tmp_path, capsys):
    assert cli.main(["launch", str(tmp_path / "nope.py")]) == 2
    assert "No script to launch at" in capsys.readouterr().err


def test_single_process_strategies_are_chief():
    assert is_chief(strategy_for(1)) is True
    assert is_chief(strategy_for(2)) is True


def test_worker_group_runs_a_module_with_python_m(tmp_path):
    package = tmp_path / "pkg_for_launch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(
        "import json, os, sys\n"
        "print(json.loads(os.environ['TF_CONFIG'])['task']['index'], __name__, sys.argv[1:])\n"
    )
    lines = []
    group = WorkerGroup(
        None, workers=2, args=["--x", "1"], env={"PYTHONPATH": str(tmp_path)},
        on_line=lambda index, line: lines.append((index, line)), module="pkg_for_launch.hello",
    ).start()
    assert group.wait(60) == [0, 0]
    assert sorted(lines) == [(0, "0 __main__ ['--x', '1']"), (1, "1 __main__ ['--x', '1']")]


@pytest.mark.parametrize("script,module", [(None, None), ("a.py", "pkg.mod")])
def test_worker_group_needs_exactly_one_of_script_and_module(script, module):
    with pytest.raises(ValueError, match=f"Received: script={script!r}, module={module!r}"):
        WorkerGroup(script, module=module)


# Orphans and signals: each script's name is unique, so `pgrep -f` finds every
# process of its group, children included.


def _survivors(marker):
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


def _count_of_survivors(marker, count, seconds=10):
    """How many processes run under `marker`, once `count` do or after `seconds`.

    A process that printed "ready" right after starting its child is not
    always listed at once on a loaded machine: one CI run found 4 of 5.
    """
    deadline = time.monotonic() + seconds
    found = len(_survivors(marker))
    while found != count and time.monotonic() < deadline:
        time.sleep(0.1)
        found = len(_survivors(marker))
    return found


def _sleeper_script(tmp_path, marker, body="", new_session=False):
    """A worker that starts a child sleeping under `marker`, says "ready", runs `body`, then sleeps.

    With `new_session`, the child leaves the worker's process group (its own session).
    """
    path = tmp_path / f"{marker}.py"
    path.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'], "
        f"start_new_session={new_session})\n"
        "print('ready', flush=True)\n"
        f"{body}"
        "time.sleep(120)\n"
    )
    return str(path)


def _launcher(path, workers=2):
    return subprocess.Popen(
        [sys.executable, "-m", "keras_safe_dist", "launch", "--workers", str(workers), path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_kills_every_worker_and_child(tmp_path, signum):
    marker = f"ksd_signal_{uuid.uuid4().hex}"
    launcher = _launcher(_sleeper_script(tmp_path, marker))
    try:
        for _ in range(2):  # both workers started their child
            assert "ready" in launcher.stdout.readline()
        launcher.send_signal(signum)
        launcher.wait(timeout=30)
        err = launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signum
    assert f"got {signal.Signals(signum).name}; killed the workers." in err
    assert _survivors(marker) == []


@pytest.mark.parametrize("new_session", [False, True], ids=["its_group", "new_session"])
def test_a_worker_that_exits_leaves_no_child_behind(tmp_path, new_session):
    marker = f"ksd_orphan_{uuid.uuid4().hex}"
    path = _sleeper_script(tmp_path, marker, body="sys.exit(0)\n", new_session=new_session)
    assert WorkerGroup(path, workers=2, on_line=lambda *_: None).start().wait(60) == [0, 0]
    assert _survivors(marker) == []


def test_a_worker_killed_by_a_signal_exits_128_plus_n(tmp_path, capsys):
    path = script(tmp_path, "import signal\nif index == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
    assert cli.main(["launch", "--workers", "2", "--timeout", "30", path]) == 128 + 9
    assert "worker 0 was killed by SIGKILL; killed the other workers." in capsys.readouterr().err


def test_bytes_that_are_not_utf8_become_replacement_characters(tmp_path, capsys):
    path = script(
        tmp_path,
        "sys.stdout.buffer.write(b'bad \\xff byte\\n'); sys.stdout.flush()\n"
        "print('after', index)\n",
    )
    assert cli.main(["launch", "--workers", "2", "--timeout", "30", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == sorted(
        [f"[worker {i}] bad \ufffd byte" for i in (0, 1)] + [f"[worker {i}] after {i}" for i in (0, 1)]
    )


def test_launch_help_and_argument_errors_return_without_loading_tensorflow():
    code = (
        "import sys, time\n"
        "sys.argv = ['keras-safe-dist', 'launch', '--workers', '0', 'x.py']\n"
        "start = time.perf_counter()\n"
        "from keras_safe_dist.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False", "False"]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist", "launch", "--help"], capture_output=True, text=True, timeout=60
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0 and "firewall" in done.stdout
    assert seconds < 2.0, seconds  # TensorFlow alone takes about 4 s to import


@pytest.mark.parametrize("new_session", [False, True], ids=["its_group", "new_session"])
def test_workers_and_their_children_end_when_the_launcher_is_killed_with_sigkill(tmp_path, new_session):
    marker = f"ksd_sigkill_{uuid.uuid4().hex}"
    launcher = _launcher(_sleeper_script(tmp_path, marker, new_session=new_session))
    try:
        for _ in range(2):  # both workers started their child
            assert "ready" in launcher.stdout.readline()
        assert _count_of_survivors(marker, 5) == 5  # the launcher, two workers, a child each
        launcher.kill()  # SIGKILL: the launcher cleans up nothing itself
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _survivors(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _survivors(marker) == []
        assert time.monotonic() < deadline
    finally:
        for pid in _survivors(marker):
            os.kill(int(pid), signal.SIGKILL)


def test_a_worker_count_the_machine_cannot_hold_is_refused_before_binding(tmp_path, capsys, monkeypatch):
    from keras_safe_dist.scale_out import launch as launch_module

    def no_binding(count):
        raise AssertionError("bound ports for a refused worker count")

    monkeypatch.setattr(_cluster, "free_ports", no_binding)  # where WorkerGroup looks it up
    path = script(tmp_path, "pass\n")
    most, reason = launch_module.max_workers()
    start = time.perf_counter()
    assert cli.main(["launch", "--workers", "100000", path]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert err.startswith(f"keras-safe-dist launch: `workers` must be at most {most} on this machine: {reason}.")
    assert "Received: workers=100000. Start fewer workers" in err


def test_the_open_file_limit_bounds_the_worker_count(monkeypatch):
    import resource

    from keras_safe_dist.scale_out import launch as launch_module

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 256))
    most, reason = launch_module.max_workers()
    from keras_safe_dist.scale_out import _cluster

    assert most == 256 - _cluster._open_files() - 32
    assert reason.startswith("this process may open 256 files (ulimit -n)")
    with pytest.raises(ValueError, match=r"or raise the limit \(ulimit -n\)\.$"):
        WorkerGroup(__file__, workers=most + 1)


_BINDS_ITS_PORT = (
    "import socket\n"
    "port = int(json.loads(os.environ['TF_CONFIG'])['cluster']['worker'][index].rsplit(':', 1)[1])\n"
    "server = socket.socket()\n"
    "server.bind(('127.0.0.1', port))\n"
    "print('bound', port)\n"
)


@pytest.mark.parametrize("taken_twice", [False, True], ids=["once", "twice"])
def test_a_port_taken_before_the_worker_binds_it_is_named_and_retried_once(tmp_path, capsys, monkeypatch, taken_twice):
    from keras_safe_dist.scale_out import launch as launch_module

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real = launch_module.free_ports
    chosen = []

    def racy_free_ports(count):
        ports = real(count)
        if len(chosen) == 0 or taken_twice:
            ports[0] = taken  # another process binds it before worker 0 does
        chosen.append(ports)
        return ports

    monkeypatch.setattr(_cluster, "free_ports", racy_free_ports)
    try:
        code = cli.main(["launch", "--workers", "2", "--timeout", "60", script(tmp_path, _BINDS_ITS_PORT)])
    finally:
        holder.close()
    out, err = capsys.readouterr()
    what = (
        f"keras-safe-dist launch: worker 0 could not bind port {taken} on 127.0.0.1: another process "
        "took it between the launcher choosing it and the worker binding it"
    )
    assert len(chosen) == 2
    assert f"{what}; starting every worker again with fresh ports." in err
    if taken_twice:
        assert code == 1
        assert f"{what}, on the second try too; giving up." in err
    else:
        assert code == 0
        assert f"[worker 0] bound {chosen[1][0]}" in out and f"[worker 1] bound {chosen[1][1]}" in out


def test_the_watcher_kills_the_groups_still_listed_when_its_pipe_closes_without_done():
    from keras_safe_dist.scale_out import _reaper

    sleepers = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        for _ in range(3)
    ]
    try:
        first, second, third = (str(p.pid) for p in sleepers)
        assert _reaper.main([f"add {first}", f"add {second}", "done"]) is None
        assert [p.poll() for p in sleepers] == [None, None, None]
        killed = _reaper.main([f"add {first}", f"add {second}", f"add {third}", f"forget {second}"])
        assert killed == [sleepers[0].pid, sleepers[2].pid]
        assert [p.wait(timeout=10) for p in (sleepers[0], sleepers[2])] == [-signal.SIGKILL] * 2
        assert sleepers[1].poll() is None
    finally:
        for process in sleepers:
            process.kill()
            process.wait()


_OWN_SERVER_FAILS = (
    "import sys\n"
    "print('OSError: [Errno 98] Address already in use: the model server on port 8500')\n"
    "sys.exit(3)\n"
)


def test_a_worker_that_fails_on_a_port_of_its_own_is_not_started_again(tmp_path, capsys, monkeypatch):
    from keras_safe_dist.scale_out import launch as launch_module

    real = launch_module.free_ports
    chosen = []
    monkeypatch.setattr(_cluster, "free_ports", lambda count: chosen.append(real(count)) or chosen[-1])
    code = cli.main(["launch", "--workers", "2", "--timeout", "60", script(tmp_path, _OWN_SERVER_FAILS)])
    out, err = capsys.readouterr()
    assert len(chosen) == 1  # started once: port 8500 is not the launcher's
    assert code == 3
    assert "starting every worker again" not in err
    assert "Address already in use: the model server on port 8500" in out


def test_a_bind_failure_counts_only_on_the_launchers_port():
    from keras_safe_dist.scale_out._workers import _bind_failure

    assert _bind_failure("OSError: [Errno 98] Address already in use: 127.0.0.1:41234", 41234)
    assert not _bind_failure("OSError: [Errno 98] Address already in use: 127.0.0.1:8500", 41234)
    assert not _bind_failure("Address already in use: port 412345", 41234)
    assert _bind_failure("UNKNOWN: Could not start gRPC server", 41234)  # TensorFlow's, on the launcher's port
