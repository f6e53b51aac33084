"""The run log: what the callbacks write into a log directory, and reading it back.

- `writer`: reports and counts written as TensorBoard text and scalar
  summaries and JSON files, from the chief only;
- `_events`: TensorBoard's event files, written without TensorFlow;
- `_log_dir`: `read_log_dir`, what `keras-safe-dist report` reads: the
  reports and findings; `_statistics`: each run's update statistics, from its
  event files; `_text`: `format_text`, what `report` prints;
- `plot`: the picture `keras-safe-dist report --plot` draws (matplotlib).

Example:

```python
from keras_safe_dist.report import format_text, read_log_dir

print(format_text(read_log_dir("logs")))
```
"""

import importlib

# public name: the private module that defines it, imported on first use
_EXPORTS = {
    "LogDirReport": "_log_dir",
    "RunStatistics": "_statistics",
    "UnreadableFile": "_log_dir",
    "format_text": "_text",
    "plot_report": "plot",
    "read_log_dir": "_log_dir",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
