"""Shared pytest setup. Service fixtures (redis-server, SeaweedFS) live in tests/services.py."""
from services import *  # noqa: F401,F403  (redis-server and SeaweedFS fixtures, tests/services.py)
