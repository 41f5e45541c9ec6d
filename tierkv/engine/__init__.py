"""tierkv.engine: the model, its loader, the sampler, the scheduler and `LLM` on top of the cache.

Nothing here knows about HTTP; the server layer above calls in. The life of a request through
these files: docs/architecture.md.
"""
