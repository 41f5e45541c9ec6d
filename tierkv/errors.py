"""The exceptions tierkv raises to its users.

Every error a user can cause says what to change. Internal faults of a tier (a dead Redis, a
corrupt file) are never raised from here: tiers count them and report a miss instead.
"""

from .kernels.errors import ShapeError as KernelShapeError  # kernels/ is the layer below everything; no torch


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration value is wrong; the message names the field and what it accepts."""


class ShapeError(TierKVError, KernelShapeError):
    """A tensor handed to the cache has the wrong shape, dtype or device. The kernels raise their
    own base of this class (tierkv.kernels.ShapeError, a ValueError): catch that to catch both."""


class ModelLoadError(ConfigError):
    """A model path or directory cannot be used; the message says what is wrong and what works."""


class OutOfMemoryError(TierKVError, MemoryError):
    """A tier asked for more memory than its device or host has."""


class CacheFullError(TierKVError):
    """L1 has no free or evictable block left for a request (everything is pinned)."""


class UsageError(TierKVError, ValueError):
    """The cache was called in a way that cannot be right: a match made for other tokens or
    another salt, a sequence that was freed or belongs to another cache, tokens that do not
    extend a sequence. The message says what to change; the call changed nothing."""


class CacheClosedError(UsageError):
    """A call on a TieredKVCache after its close(): make a new cache."""


class TensorParallelError(TierKVError, RuntimeError):
    """A tensor-parallel rank failed or exited; the message names the rank and its error. Every
    rank is stopped when this is raised: the engine cannot go on."""
