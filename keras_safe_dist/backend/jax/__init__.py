"""JAX's trainer for `SafeDistributedModel`."""
