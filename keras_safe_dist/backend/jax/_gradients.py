"""Gradient arithmetic for JAX's update: the global norm, clipping, division.

The norm is computed in float32 or wider, so that a float16 gradient's norm
cannot overflow, and summed one of two ways by the platform of the weights
(`joins_norm`). `clip` applies the model's one clipping mode.
"""

import functools

import jax.numpy as jnp

__all__ = ["clip", "divide_no_nan", "global_norm", "is_sharded", "joins_norm", "platform"]

# Whether the global norm sums the squares of the gradients joined into one
# vector (see `global_norm`): None, by the platform of the weights (in
# `_JOINED_NORM_PLATFORMS`) where none is sharded; True or False for every
# model (benchmarks/gpu_check.py --controls compares the two).
NORM_BY_CONCATENATION = None
_JOINED_NORM_PLATFORMS = frozenset({"gpu"})


def joins_norm(values):
    """Whether a step over weights `values` sums the global norm over the joined gradients."""
    if any(is_sharded(value) for value in values):
        return False  # the join would gather the shards
    if NORM_BY_CONCATENATION is not None:
        return NORM_BY_CONCATENATION
    return platform(values) in _JOINED_NORM_PLATFORMS


def global_norm(tensors, concatenate=False):
    """The global norm in float32 or wider, so a float16 gradient's norm cannot overflow.

    By default a plain sum of squares per tensor, as optax's `global_norm`:
    XLA sums a sharded gradient shard by shard and adds the partial sums
    across devices. (A matrix's squares summed as `vdot(t.T, t.T)` saved a
    copy on one CPU device, but under `ModelParallel` the transpose of a
    sharded gradient made the MLP 256-1024-1024-256's step 2.7 times stock's
    on 2 CPU devices.)

    With `concatenate`, one sum over all the tensors flattened and joined: on
    a GPU XLA fuses the join into the reduction, one kernel where the
    per-tensor sums take one each, and a step of about a millisecond is
    bound by its kernel launches (an H200's convnet step: 59 kernels against
    65 summed per tensor). Not on a CPU, where XLA:CPU's fused join and
    reduction made gpu_check's MLP epoch up to 4 times as long, nor over
    sharded tensors, which the join would gather.
    """
    wide = [t.astype(jnp.promote_types(t.dtype, jnp.float32)) for t in tensors]
    if not wide:
        return jnp.zeros((), "float32")
    if concatenate and len(wide) > 1:
        dtype = functools.reduce(jnp.promote_types, [t.dtype for t in wide])
        joined = jnp.concatenate([jnp.ravel(t).astype(dtype) for t in wide])
        return jnp.sqrt(jnp.sum(jnp.square(joined)))
    return jnp.sqrt(sum(jnp.sum(jnp.square(t)) for t in wide))


def clip(grads, norm, global_clipnorm=None, clipnorm=None, clipvalue=None):
    """The gradients clipped by the one mode given, and whether any was clipped.

    `norm` is the gradients' global norm (read by `global_clipnorm` only).
    With no mode the gradients come back as they are.
    """
    if global_clipnorm is not None:
        limit = global_clipnorm
        factor = limit * jnp.minimum(1.0 / norm, 1.0 / limit)
        return [g * factor.astype(g.dtype) for g in grads], norm > limit
    if clipnorm is not None:
        limit = clipnorm
        norms = [global_norm([g]) for g in grads]
        clipped = [
            g * (limit / jnp.maximum(n, limit)).astype(g.dtype)
            for g, n in zip(grads, norms)
        ]
        return clipped, jnp.any(jnp.stack([n > limit for n in norms]))
    if clipvalue is not None:
        limit = clipvalue
        over = jnp.any(jnp.stack([jnp.any(jnp.abs(g) > limit) for g in grads]))
        return [jnp.clip(g, -limit, limit) for g in grads], over
    return grads, jnp.zeros((), bool)


def platform(values):
    """The platform ("cpu", "gpu", "tpu") of the arrays' devices, or None if unknown or mixed."""
    platforms = set()
    for value in values:
        devices = getattr(value, "devices", None)
        if devices is None:
            return None
        platforms.update(device.platform for device in devices())
    return platforms.pop() if len(platforms) == 1 else None


def is_sharded(value):
    """Whether `value` is split across devices (not replicated, nor on one device)."""
    spec = getattr(getattr(value, "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def divide_no_nan(numerator, denominator):
    """`numerator / denominator`, and 0 where the denominator is 0."""
    safe = jnp.where(denominator == 0, jnp.ones_like(denominator), denominator)
    return jnp.where(denominator == 0, jnp.zeros_like(numerator), numerator / safe)
