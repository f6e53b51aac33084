"""Scaling out: several processes on one machine or several.

- `launch`: `keras-safe-dist launch`'s launcher, as a Python API (`launch`,
  `WorkerGroup`, `free_ports`, `tf_config`), MultiWorkerMirroredStrategy
  workers or JAX processes on 127.0.0.1;
- `_reaper`: the watcher that kills a launcher's workers when the launcher
  dies, even by SIGKILL;
- `distributed`: who is who in a cluster (`keras_safe_dist.is_chief`) and
  joining one on JAX (`keras_safe_dist.initialize`).

Importing the folder imports nothing else.
"""
