"""The update rule both backends follow, and its statistics.

- `_loss`: a micro-batch's loss split into a numerator and a denominator that
  add up exactly across micro-batches and replicas;
- `_rule`: the update statistics' rule, one vector updated once per update,
  applied or skipped;
- `statistics`: the statistics' names and descriptions, shared by the step, the
  `Dashboard` and `report` (no TensorFlow, no Keras);
- `_progbar`: Keras's progress bar without the statistics.
- `options`: `SafeDistributedModel`'s options, their defaults and checks (a
  misspelled option or an optimizer's own clipping refused).

Each backend's step (`backend/tensorflow/_update.py`, `backend/jax/_update.py`)
applies this rule. Importing the folder imports nothing else.
"""
