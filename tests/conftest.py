"""Shared pytest setup. Service fixtures (redis-server, SeaweedFS) live in tests/services.py."""
