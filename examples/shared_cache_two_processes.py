"""Two processes share one Redis L3: the second process's first request reuses what the first computed.

The script starts redis-server on a free loopback port (or uses --redis URL), then runs itself twice
as separate worker processes. Each worker loads the model with transformers and builds its own
TieredKVCache (private L1, Redis as L3). Worker "a" answers one question about a shared manual and
flushes its blocks to Redis; worker "b" then asks a different question and finds the manual's
blocks in L3 before computing anything. Block names are the same chained hashes in every process.
Run: python examples/shared_cache_two_processes.py [--redis redis://127.0.0.1:6379/0] [--model HF_DIR]
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

MANUAL = ("Operating manual of the DX-200 coffee machine. Fill the tank with cold water only. Press the "
          "left button once for espresso and twice for a double espresso. Press the right button for hot "
          "water. Descale every 200 cups with the supplied tablets. The red light means the tank is empty; "
          "the blinking orange light means descaling is due. Never open the brewing unit while it is hot.")
QUESTIONS = {"a": "How do I make a double espresso?", "b": "What does the blinking orange light mean?"}


def worker(name: str, url: str, model_dir: str, max_new_tokens: int) -> None:
    import torch
    from tierkv.integrations.transformers import generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tierkv

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    c = model.config
    layout = tierkv.KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                             head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                             dtype=torch.float32, block_size=16)
    # the model name is part of every block's hash namespace: both workers must pass the same one
    kv = tierkv.TieredKVCache(layout, tierkv.CacheConfig(l1="128MiB", l2="128MiB", l3=[url]),
                              device="cpu", model=os.path.basename(os.path.normpath(model_dir)))
    messages = [{"role": "system", "content": MANUAL}, {"role": "user", "content": QUESTIONS[name]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    before = kv.match(ids[0].tolist())  # what this fresh process can find before computing anything
    with torch.inference_mode():
        out = generate(model, ids, kv, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
    print(f"[{name}] pid {os.getpid()}: {QUESTIONS[name]} -> {answer}")
    print(f"[{name}] first request: prompt {out.prompt_tokens} tokens, found before compute {before.by_tier}, "
          f"cached tokens {out.cached_tokens} (from L3: {out.by_tier['l3']}), computed {out.computed_tokens}, "
          f"{out.seconds:.2f}s")
    kv.flush(timeout=30)  # every block is in Redis before this process exits
    stores = [{k: s[k] for k in ("url", "puts", "hits")} for s in kv.stats()["l3_stores"]]
    print(f"[{name}] L3 stores: {stores}")
    kv.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (apt-get install -y redis-server), or pass --redis URL")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(200):  # wait up to 10 s for the port to open
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default=None, help="an existing Redis URL (default: start redis-server here)")
    parser.add_argument("--model", default=None, help="a local HF model dir (default: bundled SmolLM2-135M)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--worker", choices=sorted(QUESTIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.redis, args.model, args.max_new_tokens)

    if args.model is None:
        from tierkv.engine.loader import bundled_model_dir

        args.model = str(bundled_model_dir())  # converted once here, so the workers only load it
    workdir = tempfile.mkdtemp(prefix="tierkv-redis-")
    redis_proc, url = (None, args.redis) if args.redis else start_redis(workdir)
    print(f"L3: {url}{' (started here)' if redis_proc else ''}")
    try:
        for name in ("a", "b"):  # one after the other: b starts after a has flushed and exited
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--redis", url,
                   "--model", args.model, "--max-new-tokens", str(args.max_new_tokens)]
            subprocess.run(cmd, check=True)
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
