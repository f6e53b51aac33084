"""The doctor's probes that both backends run, measured once.

Each module's `run(backend, place)` takes the backend's `_tiny` module
(`doctor/probes/_tiny.py` or `doctor/jax/probes/_tiny.py`, a `tiny.Tiny`) and
the place to train in; each backend's probe module keeps its docstring, its
`checks` text and its batch layout. Nothing here imports a backend library.
"""

__all__ = []
