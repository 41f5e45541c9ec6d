"""The parts of benchmarks/bench_serving.py, one concept a module: workloads, model, client, probes,
sweep, session, servers, figures, bounds, ratios and report; and ttft_clients, the clients
bench_server_overhead.py times. bench_serving.py puts benchmarks/ and
tests/ on sys.path first (these modules import `common`, `limits` and `server_helpers` by name);
nothing here is meant to run on its own, and nothing here may read server state beyond the public
HTTP API.
"""
