"""TensorFlow's trainer for `SafeDistributedModel`."""
