"""tierkv under vLLM: TierKVConnector puts tierkv's L2 and L3 beneath vLLM's own KV cache,
through vLLM's v1 KV-connector API. One flag turns it on:

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"l2": "8GiB", "l3": ["file:///var/cache/tierkv"]}}'

Files, one concept each: options.py (what the config may say, the blocks' names), records.py (what
crosses vLLM's process boundary), scheduler_side.py (the decider, in vLLM's scheduler process),
worker_side.py (the copies, in each worker), connector.py (vLLM's method names onto those).
TierKVConnector (and so vLLM) is imported on first use, so that the worker's half runs where
vLLM is not installed (the H200 harness, benchmarks/bench_vllm_worker.py); nothing else in
tierkv imports vLLM. See docs/vllm.md.
"""

__all__ = ["TierKVConnector"]


def __getattr__(name: str):
    if name == "TierKVConnector":  # vLLM's factory: getattr(import_module(kv_connector_module_path), name)
        from .connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
