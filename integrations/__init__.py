"""tierkv.integrations: adapters that put a TieredKVCache inside other engines.

Each adapter lives in its own module and is imported on demand, so that importing this package
never imports the engine it adapts.
"""
