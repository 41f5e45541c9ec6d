"""tierkv.server: `tierkv-serve`, an OpenAI-compatible HTTP server over tierkv's engine.

The top layer: it imports the engine, never the other way round. Needs the `serve` extra
(fastapi, uvicorn, prometheus-client); importing this package alone imports none of them.
Where a request goes after this layer: docs/architecture.md.
"""
