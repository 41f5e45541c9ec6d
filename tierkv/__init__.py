"""tierkv: a three-tier KV cache for LLM inference (GPU pool, pinned host pool, disk/S3/Redis).

The public names live here, imported on first use. docs/architecture.md maps the layers below
them, the life of a request and of a block, and where each decision is made.
"""

from . import errors

__all__ = ["LLM", "CacheConfig", "KVLayout", "Match", "SamplingParams", "SequenceBlocks", "TieredKVCache", "errors"]

# Public name -> module that defines it. Imported on first use, so that `import tierkv.kernels`
# (or tierkv.errors) loads without the cache, and the engine (transformers and friends) only
# when someone asks for it.
_LAZY = {
    "TieredKVCache": "cache", "SequenceBlocks": "cache", "Match": "plan", "CacheConfig": "config",
    "KVLayout": "layout", "LLM": "engine.llm", "SamplingParams": "engine.sampler",
    "RequestOutput": "engine.request",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"
