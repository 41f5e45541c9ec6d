"""The benchmark clients people point at a vLLM server, pointed at tierkv-serve: guidellm and aiperf.

One server for the module (the bundled SmolLM2 on the CPU, under its hub id); each client sends
three short requests (64-token synthetic prompts, 8 tokens out) and must see every one complete.
guidellm streams with `stream_options.continuous_usage_stats` and counts tokens from the usage in
each chunk; aiperf resets the prefix cache first (`--reset-kv-cache`: POST /reset_prefix_cache)
and scrapes /metrics. Both tokenize the synthetic prompts themselves, with the tokenizer files in
the directory /v1/models names (`root`): no hub access.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from server_helpers import metric, serving

pytest.importorskip("fastapi")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 3, 64, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(["--l1", "64MiB", "--max-model-len", "512"], tmp_path_factory.mktemp("bench") / "server.log") as srv:
        yield srv


def tokenizer_dir(server) -> str:
    (card,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert card["id"] == MODEL
    return card["root"]


def run(module: str, args: list[str], tmp_path, unset: tuple[str, ...] = ()) -> None:
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, f"{module} {' '.join(args)}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"


def routed(server, route: str) -> float:
    return metric(httpx.get(server.url + "/metrics", timeout=30).text, "tierkv_requests_total",
                  f'route="{route}",status="200"')


def test_guidellm_completes_every_request(server, tmp_path):
    pytest.importorskip("guidellm")
    before = routed(server, "/v1/chat/completions")
    backend = f"kind=openai_http,target={server.url},model={MODEL},request_format=/v1/chat/completions"
    run("guidellm", ["run", "--backend", backend, "--profile", "kind=synchronous",
                     "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                     "--constraint", f"kind=max_requests,count={REQUESTS}",
                     "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir(server)}",
                     "--output", f"kind=json,path={tmp_path / 'report.json'}", "--disable-console-interactive"],
        tmp_path)
    (bench,) = json.loads((tmp_path / "report.json").read_text())["benchmarks"]
    requests = bench["requests"]
    # (once in a full run, 2 of 3 came back successful: what went wrong with the third, and the server's side)
    failed = [{"kind": kind, "status": r["info"]["status"], "error": r["info"]["error"],
               "traceback": (r["info"].get("traceback") or "")[-800:]} for kind in ("errored", "incomplete")
              for r in requests[kind]]
    assert len(requests["successful"]) == REQUESTS and not failed, (failed, server.log()[-3000:])
    for r in requests["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert r["output"]  # the text came back, chunk by chunk
    assert routed(server, "/v1/chat/completions") - before == REQUESTS


def test_aiperf_resets_the_cache_and_completes_every_request(server, tmp_path):
    pytest.importorskip("aiperf")
    resets = routed(server, "/reset_prefix_cache")
    # aiperf treats a local tokenizer path as a hub id when HF_HUB_OFFLINE is set; unset, it reads the path
    run("aiperf", ["profile", "--model", MODEL, "--url", server.url, "--endpoint-type", "chat", "--streaming",
                   "--request-count", str(REQUESTS), "--concurrency", "1", "--isl", str(PROMPT_TOKENS), "--osl",
                   str(OUTPUT_TOKENS), "--tokenizer", tokenizer_dir(server), "--reset-kv-cache",
                   "--artifact-dir", str(tmp_path / "aiperf"), "--ui", "none"], tmp_path,
        unset=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    report = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == REQUESTS and not report.get("error_summary")
    assert routed(server, "/reset_prefix_cache") > resets
    # it scraped /metrics: the vLLM-named series are among what it collected
    scraped = json.loads((tmp_path / "aiperf" / "server_metrics_export.json").read_text())["metrics"]
    assert "vllm:num_requests_waiting" in scraped and "tierkv_prefix_cache_hit_tokens" in scraped
