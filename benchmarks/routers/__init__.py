"""The parts of benchmarks/bench_routers.py, one concept a module: fleet (a Redis L3, the tierkv-serve
replicas over it and the routers in front) and workloads (the multi-round chats they serve).
bench_routers.py and tests/test_routers.py put benchmarks/ and tests/ on sys.path first (these
modules import `serving` and `server_helpers` by name); nothing here runs on its own, and nothing
here reads a server's state but through HTTP and Redis.
"""
