"""Who is who in a multi-worker cluster."""

import keras

from keras_safe_dist._lazy import tensorflow as tf


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
        return _jax_process()[0] == 0
    task_type, task_id, cluster = _task(strategy)
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in cluster


def strategy_of(model):
    """`model.distribute_strategy` on TensorFlow; None on JAX, which has no strategy.

    Callbacks pass it to `is_chief` and to `keras_safe_dist.summaries`; None
    there means this process's own role (process 0 is the chief on JAX).
    """
    if keras.backend.backend() != "tensorflow":
        return None
    return model.distribute_strategy


def worker_name(strategy=None):
    """`"<task type>_<index>"` in a cluster (`"process_<index>"` on JAX), `"chief"` in one process."""
    if strategy is None and keras.backend.backend() == "jax":
        index, count = _jax_process()
        return "chief" if count == 1 else f"process_{index}"
    task_type, task_id, _ = _task(strategy)
    return "chief" if task_type is None else f"{task_type}_{task_id}"


def _task(strategy):
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return None, None, {}
    return resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()


def _jax_process():
    """This process's index and the process count under `jax.distributed`."""
    import jax  # the JAX backend only: Keras imported it already

    return jax.process_index(), jax.process_count()
