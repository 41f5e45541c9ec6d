"""tierkv: a three-tier KV cache for LLM inference (GPU pool, pinned host pool, disk/S3/Redis).

The public names live here; see DESIGN.md for the layers below them.
"""

from . import errors
from .cache import Match, SequenceBlocks, TieredKVCache
from .config import CacheConfig
from .layout import KVLayout

__all__ = ["LLM", "CacheConfig", "KVLayout", "Match", "SamplingParams", "SequenceBlocks", "TieredKVCache", "errors"]


def __getattr__(name: str):
    # The engine pulls in transformers and friends: import it only when someone asks for it.
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from .engine import llm, request, sampler

        return {"LLM": llm.LLM, "SamplingParams": sampler.SamplingParams, "RequestOutput": request.RequestOutput}[name]
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
__version__ = "0.1.0"
