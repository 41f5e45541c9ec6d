"""Runs vLLM (the CPU build, in its own venv: scripts/vllm_env.sh) offline with TierKVConnector,
through a list of steps given as JSON, and prints one JSON line of what each step saw. The tests
in test_vllm_connector.py run it; it is not collected by pytest (no test_ prefix).

usage: python vllm_driver.py '<json>'   with keys:
  model: a Hugging Face directory; extra: kv_connector_extra_config; llm: more LLM(...) arguments;
  steps: a list of {"generate": [prompts: text or token ids], "sampling": {...}} | {"reset": true, "connector": bool}
         | {"spoil_disk": dir, "how": "flip" | "truncate" | "delete", "count": n}
         | {"flush_redis": url}: empty that Redis
         | {"stats": true}: tierkv's counters (in-process engines only: VLLM_ENABLE_V1_MULTIPROCESSING=0)
         | {"kv_groups": true}: whether vLLM's hybrid KV-cache manager is on, and its KV-cache groups
"""

import json
import os
import sys


def generate(llm, step):
    from vllm import SamplingParams

    params = SamplingParams(**{"temperature": 0, "max_tokens": 8, "logprobs": 1, **step.get("sampling", {})})
    # a prompt given as token ids goes in as such (a checkpoint without a tokenizer)
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in step["generate"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [dict(prompt_tokens=len(o.prompt_token_ids), num_cached_tokens=o.num_cached_tokens,
                 finish=[c.finish_reason for c in o.outputs],
                 tokens=[list(c.token_ids) for c in o.outputs],
                 logprobs=[[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in o.outputs])
            for o in outs]


def spoil_disk(step):
    """Damage the newest `count` objects of a disk L3: flip a byte in the middle, cut the second
    half off, or delete them."""
    files = sorted((os.path.join(d, f) for d, _, fs in os.walk(step["spoil_disk"]) for f in fs
                    if not f.startswith(".") and not f.endswith(".tmp") and "index" not in f), key=os.path.getmtime)
    spoiled = files[-step.get("count", 1):]
    for path in spoiled:
        if step.get("how", "flip") == "delete":
            os.unlink(path)
        elif step["how"] == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
    return {"spoiled": len(spoiled), "of": len(files)}


def stats(llm):
    """The scheduler connector's cache counters, where the engine core runs in this process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return None
    side = core.scheduler.connector.scheduler
    c = side.cache.stats()
    return {"hit_tokens": c["hit_tokens"], "l3_errors": c["tiers"]["l3"]["errors"],
            "preemptions": side.preemptions, "resumed_hit_tokens": side.resumed_hit_tokens,
            "by_tier": {t: c["tiers"][t]["hit_tokens"] for t in ("l2", "l3")},
            # each KV-cache group's cache: the blocks and bytes it loaded from L2
            "groups": [{k: g.stats()["tiers"]["l2"][k] for k in ("blocks_out", "bytes_out")} for g in side.caches]}


def kv_groups(llm):
    """Whether vLLM runs its hybrid KV-cache manager, and each KV-cache group's kind and layers."""
    config = llm.llm_engine.vllm_config
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    groups = [] if core is None else [
        {"kind": type(g.kv_cache_spec).__name__, "window": getattr(g.kv_cache_spec, "sliding_window", None),
         "layers": list(g.layer_names)} for g in core.scheduler.kv_cache_config.kv_cache_groups]
    return {"hybrid_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager, "groups": groups}


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=spec.get("extra", {}))
    kw = dict(model=spec["model"], block_size=32, max_model_len=2048, enforce_eager=True, dtype="float32", seed=0,
              kv_transfer_config=transfer)
    llm = LLM(**{**kw, **spec.get("llm", {})})
    seen = []
    for step in spec["steps"]:
        if "generate" in step:
            seen.append(generate(llm, step))
        elif "reset" in step:
            seen.append(llm.reset_prefix_cache(reset_connector=step.get("connector", False)))
        elif "spoil_disk" in step:
            seen.append(spoil_disk(step))
        elif "flush_redis" in step:
            import redis

            seen.append(redis.Redis.from_url(step["flush_redis"]).flushdb())
        elif "stats" in step:
            seen.append(stats(llm))
        elif "kv_groups" in step:
            seen.append(kv_groups(llm))
    print("DRIVER_RESULT " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
