"""Strict JSON (RFC 8259) for every JSON document keras_safe_dist writes.

JSON has no NaN or infinity; Python's `json` writes them as bare `NaN` and
`Infinity` tokens that other parsers (`JSON.parse`, `jq`, Go, Rust) reject.
Here a non-finite number becomes a string: `"NaN"`, `"Infinity"` or
`"-Infinity"`. A reader tells a NaN from an overflow, and `float(value)` in
Python and `Number(value)` in JavaScript turn the string back into the
number. Finite numbers, strings, booleans and null are written as they are.

It imports neither TensorFlow nor Keras (the `report` command uses it).
"""

import json
import math
import numbers

from keras_safe_dist.core import _files

__all__ = ["NON_FINITE", "dumps", "strict", "write"]

# The string each non-finite value is written as.
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def strict(data):
    """`data` with every non-finite number replaced by its string.

    Dicts, lists and tuples are copied (tuples become lists); numbers of
    other types (NumPy scalars) become Python numbers.

    Args:
        data: JSON-ready data.

    Returns:
        Data that `json.dumps(..., allow_nan=False)` accepts.

    Example:

    ```python
    strict({"loss": float("nan"), "steps": [1, float("inf")]})
    # {"loss": "NaN", "steps": [1, "Infinity"]}
    ```
    """
    if isinstance(data, dict):
        return {key: strict(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict(value) for value in data]
    if isinstance(data, bool) or data is None or isinstance(data, str):
        return data
    if isinstance(data, numbers.Integral):
        return int(data)
    if isinstance(data, numbers.Real):
        value = float(data)
        return value if math.isfinite(value) else NON_FINITE[str(value)]
    return data


def dumps(data, **kwargs):
    """`json.dumps` of `strict(data)` that refuses any non-finite number left.

    Args:
        data: JSON-ready data.
        **kwargs: passed to `json.dumps` (`indent`, `sort_keys`...).

    Returns:
        The JSON text, a str.
    """
    return json.dumps(strict(data), allow_nan=False, **kwargs)


def write(path, data):
    """Writes `data` as indented strict JSON to `path`, whole or not at all.

    The text goes to a file beside `path`, which then replaces `path` in one
    step: a reader sees the previous file or the new one, never half of one.

    Args:
        path: the file to write.
        data: JSON-ready data.

    Returns:
        `path`.
    """
    text = dumps(data, indent=2, sort_keys=True) + "\n"
    with _files.written_whole(path) as f:
        f.write(text)
    return path
