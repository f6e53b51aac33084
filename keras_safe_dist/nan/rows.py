"""Which rows of the arrays given to `fit()` a NaN onset batch's non-finite rows are.

Keras shuffles the rows of arrays each epoch, so a row of the onset batch
("row 24 of batch 6") says nothing about where the sample is in the user's
own array. When `fit()` got arrays, the non-finite rows of the captured batch
are looked up in them by content: only the user's rows that hold a
non-finite value are candidates, compared with NaN counted equal to NaN. A
validation split takes rows from the end of the same arrays, so the indices
stay those of the arrays passed.
"""

import keras
import numpy as np

__all__ = ["fit_arrays", "user_rows"]

# Datasets, generators and PyDatasets are not looked into.
DATA_NOTE = (
    "fit() got a dataset or generator, so the sample's place in your data is not known: "
    "nan_onset_batch.npz holds the batch; look for the row with a non-finite value in it "
    "(e.g. np.argwhere(~np.isfinite(batch['x']))) and find that sample in your pipeline, "
    "before shuffling."
)


def fit_arrays(args, kwargs):
    """`{"x": ..., "y": ..., "sample_weight": ...}` of a `fit()` call, when all given are arrays.

    Returns None when `x` is not an array or a structure of arrays (a
    dataset, a generator). Holds references only: nothing is copied.
    """
    names = ("x", "y")
    given = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    given["sample_weight"] = kwargs.get("sample_weight")
    if given.get("x") is None:
        return None
    for leaf in keras.tree.flatten(given):
        if leaf is not None and not _is_array(leaf):
            return None
    return given


def user_rows(arrays, named):
    """Indices of `arrays` (from `fit_arrays`) holding the onset batch's non-finite rows.

    Args:
        arrays: the dict `fit_arrays` returned.
        named: `{share: (names, arrays)}` of the captured batch, its arrays
            named `x`, `x.0`, `y`, `sample_weight`...

    Returns:
        A sorted list of int; empty when no row matched.
    """
    columns = _columns(arrays)
    if not columns:
        return []
    candidates = np.zeros(len(next(iter(columns.values()))), bool)
    for column in columns.values():
        candidates |= ~_finite_rows(column)
    candidates = np.flatnonzero(candidates)
    found = set()
    for names, batch_arrays in named.values():
        batch = {name: np.asarray(a) for name, a in zip(names, batch_arrays) if name in columns}
        if not batch:
            continue
        bad = np.zeros(len(next(iter(batch.values()))), bool)
        for column in batch.values():
            bad |= ~_finite_rows(column)
        for row in np.flatnonzero(bad):
            for index in candidates:
                if all(_same(columns[n][index], batch[n][row]) for n in batch):
                    found.add(int(index))
    return sorted(found)


def _columns(arrays):
    """`{name: NumPy array}` named as the captured batch names them (`x`, `x.0`, ...)."""
    columns = {}
    for name in ("x", "y", "sample_weight"):
        flat = [a for a in keras.tree.flatten(arrays.get(name)) if a is not None]
        for i, array in enumerate(flat):
            array = np.asarray(array)
            if array.ndim == 0 or not np.issubdtype(array.dtype, np.number):
                continue
            columns[name if len(flat) == 1 else f"{name}.{i}"] = array
    lengths = {len(a) for a in columns.values()}
    return columns if len(lengths) == 1 else {}


def _finite_rows(array):
    if not np.issubdtype(array.dtype, np.floating):
        return np.ones(len(array), bool)
    return np.isfinite(array.reshape(len(array), -1)).all(axis=1)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a, b.astype(a.dtype), equal_nan=True)


def _is_array(leaf):
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") and not hasattr(leaf, "element_spec")
