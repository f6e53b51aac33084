"""Who is who in a multi-worker cluster, and joining one on JAX."""

import keras

from keras_safe_dist.core._lazy import tensorflow as tf


def initialize(coordinator_address=None, num_processes=None, process_id=None, timeout=60):
    """Joins a multi-process JAX run, with every wait bounded by `timeout`.

    Call it instead of `keras.distribution.initialize()`, first thing in the
    script, on every process. It reads the same settings: the arguments, else
    Keras's variables `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the first address is
    the coordinator, process 0), `KERAS_DISTRIBUTION_NUM_PROCESSES` and
    `KERAS_DISTRIBUTION_PROCESS_ID`, else what jax finds by itself (Slurm,
    Open MPI, Kubernetes, Cloud TPU). CPU devices exchange data over gloo.

    Beyond Keras's call: a process that cannot reach the coordinator within
    `timeout` seconds raises, and so does a second process of the run with
    the same process id on one machine. Where the processes reach the
    coordinator but not all of them register within `timeout` (a process
    count above the processes started, a process id taken on another
    machine), jax's wait cannot be interrupted: the process prints the cause
    and exits with status 1. Once joined, when any process fails (raises out
    of `fit()`, `evaluate()` or `predict()`, exits, is killed, or ends its
    script while another starts a call it never makes), every other process
    prints which one and exits with status 1 within `timeout` seconds,
    instead of waiting in a collective for good. See docs/scaling_out.md.

    Args:
        coordinator_address: `"host:port"` of process 0.
        num_processes: how many processes the run has.
        process_id: this process's index, 0 to `num_processes - 1`.
        timeout: seconds, integer >= 10: the bound on joining, on noticing
            a dead process and on shutting down.

    Returns:
        `(process_id, num_processes)`.

    Raises:
        ValueError: for a bad argument or variable, or on TensorFlow's backend
            (`tf.distribute.MultiWorkerMirroredStrategy` reads `TF_CONFIG`).
        RuntimeError: when this process could not reach the coordinator
            within `timeout`, or another process on this machine joined the
            run with the same process id.

    Example:

    ```python
    import keras_safe_dist

    keras_safe_dist.initialize()  # before any other JAX call
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    ```
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 10:
        raise ValueError(f"`timeout` must be an integer >= 10 (seconds). Received: timeout={timeout!r}")
    if keras.backend.backend() != "jax":
        raise ValueError(
            "`keras_safe_dist.initialize()` starts a multi-process JAX run. On "
            f"Keras's {keras.backend.backend()!r} backend, use "
            "`tf.distribute.MultiWorkerMirroredStrategy()` with a `TF_CONFIG` instead "
            "(see docs/scaling_out.md), or set KERAS_BACKEND=jax."
        )
    from keras_safe_dist.backend.jax import processes

    return processes.initialize(coordinator_address, num_processes, process_id, timeout)


def is_chief(strategy=None):
    """Whether this process is the chief: the one that writes shared files.

    The chief is the task of type `"chief"` if the cluster has one, otherwise
    worker 0. Single-process strategies have only a chief.

    Args:
        strategy: a `tf.distribute.Strategy`; defaults to the current one.

    Returns:
        bool.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if keras_safe_dist.is_chief(strategy):
        model.save("model.keras")  # one worker writes shared files
    ```
    """
    if strategy is None and keras.backend.backend() == "jax":
        # No tf.distribute cluster on JAX: the chief is process 0.
        return jax_process()[0] == 0
    task_type, task_id, cluster = _task(strategy)
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in cluster


def strategy_of(model):
    """`model.distribute_strategy` on TensorFlow; None on JAX, which has no strategy.

    Callbacks pass it to `is_chief` and to `keras_safe_dist.report.writer`; None
    there means this process's own role (process 0 is the chief on JAX).
    """
    if keras.backend.backend() != "tensorflow":
        return None
    return model.distribute_strategy


def worker_name(strategy=None):
    """`"<task type>_<index>"` in a cluster (`"process_<index>"` on JAX), `"chief"` in one process."""
    if strategy is None and keras.backend.backend() == "jax":
        index, count = jax_process()
        return "chief" if count == 1 else f"process_{index}"
    task_type, task_id, _ = _task(strategy)
    return "chief" if task_type is None else f"{task_type}_{task_id}"


def _task(strategy):
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return None, None, {}
    return resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()


def jax_process():
    """This process's index and the process count under `jax.distributed`."""
    import jax  # the JAX backend only: Keras imported it already

    return jax.process_index(), jax.process_count()
