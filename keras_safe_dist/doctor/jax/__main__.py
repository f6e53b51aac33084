"""`python -m keras_safe_dist.doctor.jax`: the JAX doctor's own process (see `runner.py`)."""

import sys

from keras_safe_dist.doctor.jax.runner import main

sys.exit(main())
