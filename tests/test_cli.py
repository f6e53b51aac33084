"""The `keras-safe-dist` command's help: true on both backends, TensorFlow and JAX."""

import pytest

from keras_safe_dist import cli
from keras_safe_dist.scale_out import launch


def help_text(capsys, *argv):
    """What `keras-safe-dist ARGV --help` prints, its lines joined by single spaces."""
    with pytest.raises(SystemExit) as exit:
        cli.main([*argv, "--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_command_and_verbose_name_both_backends(capsys):
    text = help_text(capsys)
    assert (
        "Correct, observable data-parallel Keras 3 training on TensorFlow (tf.distribute) "
        "and JAX (keras.distribution)." in text
    )
    assert (
        "--verbose also print the C++ log lines TensorFlow and JAX's XLA write at start-up "
        "(hidden by default)" in text
    )
    assert "launch run a script as several local workers (TensorFlow or JAX)" in text


def test_launch_help_names_each_backends_workers_and_listening_service(capsys):
    text = help_text(capsys, "launch")
    assert "a TF_CONFIG each (--backend tensorflow, MultiWorkerMirroredStrategy)" in text
    assert "KERAS_DISTRIBUTION_* variables and gloo CPU collectives (--backend jax, jax.distributed)" in text
    assert (
        "TensorFlow's worker service and JAX's coordinator (process 0, unless "
        "JAX_COORDINATOR_BIND_ADDRESS is set) listen on every network interface" in text
    )
    assert launch.__doc__.splitlines()[0] == (
        "Start a script as several local workers: TensorFlow's or JAX's processes."
    )


def test_doctor_help_says_what_each_backend_runs_on(capsys):
    text = help_text(capsys, "doctor")
    assert text.count("Prints the Python, Keras and backend versions") == 1
    assert "--backend tensorflow (the default) splits the CPU into N logical devices under a MirroredStrategy" in text
    assert "--backend jax runs the probes that exist on Keras's JAX backend" in text
    assert "CPU devices to train on, integer >= 2 (default 2): TensorFlow's logical devices, or JAX's CPU devices" in text


def test_report_help_offers_the_plot_and_its_extra(capsys):
    text = help_text(capsys, "report")
    assert "[--plot FILE.png]" in text
    assert "needs the [plot] extra, matplotlib" in text
    assert "without matplotlib, or with no statistics to draw, the exit status is 2" in text
