"""tierkv: a three-tier KV cache for LLM inference (GPU pool, pinned host pool, disk/S3/Redis).

The public names live here; see DESIGN.md for the layers below them.
"""

from . import errors
from .cache import Match, SequenceBlocks, TieredKVCache
from .config import CacheConfig
from .layout import KVLayout

__all__ = ["CacheConfig", "KVLayout", "Match", "SequenceBlocks", "TieredKVCache", "errors"]
__version__ = "0.1.0"
