"""What the benchmarks share: timed regions free of garbage collection."""

import contextlib
import gc


@contextlib.contextmanager
def no_collection():
    """No garbage collection inside a timed region.

    `fit()` leaves reference cycles that hold tf.data iterators, and freeing an
    old one waits for its background threads (seconds, up to a minute). The
    garbage of earlier runs is collected before the timer starts, and what
    survives is frozen, so that each collection stays short.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
