"""`python -m keras_safe_dist`: the same as the `keras-safe-dist` command."""

import sys

from keras_safe_dist.cli import main

sys.exit(main())
