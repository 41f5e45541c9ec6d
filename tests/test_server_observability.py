"""What an operator reads off a real tierkv-serve: /metrics against what the requests did.

One server for the module: the tiny word-level model (tests/load_helpers.py: token i is the
word "w{i}", so a prompt's token count is its word count), an L1 of 16 blocks so that three
growing requests preempt one another, driven by the real openai client. /metrics is parsed with
prometheus_client's own text parser, as Prometheus and production-stack's router read it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from load_helpers import BLOCK, BLOCK_BYTES, MODEL, SERVER_ENV, tiny_model  # noqa: F401  (tiny_model: a fixture)
from server_helpers import serving
from tierkv.engine.stats import INTER_TOKEN_S, ITERATION_TOKENS, REQUEST_PHASE_S, one_two_five

openai = pytest.importorskip("openai")

L1_BLOCKS = 16


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("observability") / "serve.log"
    with serving(["--model", str(tiny_model), "--served-model-name", MODEL, "--l1", str(L1_BLOCKS * BLOCK_BYTES),
                  "--log-level", "info"], log, env=SERVER_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def scrape(server) -> dict[str, tuple[str, list]]:
    """{family name: (type, samples)} of /metrics, as prometheus_client's parser reads it."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(families, sample: str, **labels) -> float:
    """The one sample named `sample` whose labels include `labels` (0 when there is none)."""
    found = [s.value for _, samples in families.values() for s in samples
             if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) <= 1, (sample, labels, found)
    return found[0] if found else 0.0


def prompt(first: int, n: int) -> str:
    return " ".join(f"w{first + i}" for i in range(n))


def complete(client, text: str, max_tokens: int):
    return client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def until(server, check, timeout: float = 20.0):
    """Scrape until `check(families)` holds (the engine's counters reach /metrics between steps)."""
    end = time.monotonic() + timeout
    while True:
        families = scrape(server)
        if check(families) or time.monotonic() > end:
            return families
        time.sleep(0.1)


# ---------------------------------------------------------------------------- vLLM's series


def test_prefix_cache_series_under_vllms_old_and_new_names(server, client):
    """production-stack's router reads vllm:gpu_prefix_cache_hits_total, _queries_total and
    vllm:gpu_prefix_cache_hit_rate (vLLM's names before 0.10): the same counts as
    vllm:prefix_cache_*, and their ratio since the start."""
    before = scrape(server)
    text = prompt(100, 4 * BLOCK)
    complete(client, text, 1)
    again = complete(client, text, 1)
    # a hit is whole blocks, and the prompt's last token is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    after = until(server, lambda f: value(f, "vllm:gpu_prefix_cache_hits_total") > value(
        before, "vllm:gpu_prefix_cache_hits_total"))
    for kind in ("queries", "hits"):
        old, new = f"vllm:gpu_prefix_cache_{kind}", f"vllm:prefix_cache_{kind}"
        assert after[old][0] == "counter"
        (sample,) = after[old][1]
        assert sample.labels == {"model_name": MODEL, "engine": "0"}
        assert sample.value == value(after, new + "_total") > 0
    assert value(after, "vllm:gpu_prefix_cache_hits_total") - value(before, "vllm:gpu_prefix_cache_hits_total") \
        == 3 * BLOCK
    assert value(after, "vllm:gpu_prefix_cache_queries_total") - value(
        before, "vllm:gpu_prefix_cache_queries_total") == 2 * (4 * BLOCK - 1)
    assert after["vllm:gpu_prefix_cache_hit_rate"][0] == "gauge"
    assert value(after, "vllm:gpu_prefix_cache_hit_rate", model_name=MODEL) == pytest.approx(
        value(after, "vllm:gpu_prefix_cache_hits_total") / value(after, "vllm:gpu_prefix_cache_queries_total"))


def bucket_bounds(families, name: str) -> list[str]:
    return [s.labels["le"] for s in families[name][1] if s.name == name + "_bucket"]


def test_request_and_step_histograms_count_what_the_requests_did(server, client):
    """Three requests at once, then vLLM's step and request series against their usage, with
    vLLM's buckets and labels: prompt tokens per request, tokens per step (prompts when they get
    their first token, plus every token sampled), one gap per token after the first, and each
    request's queue, prefill and decode times, within its end-to-end latency."""
    before = scrape(server)
    prompts = [prompt(200 + 80 * i, 4 * BLOCK + 3 * i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: complete(client, p, 3 * BLOCK), prompts))
    prompt_tokens = [o.usage.prompt_tokens for o in outs]
    completion_tokens = [o.usage.completion_tokens for o in outs]
    assert prompt_tokens == [4 * BLOCK + 3 * i for i in range(3)] and completion_tokens == [3 * BLOCK] * 3

    def delta(families, sample):
        return value(families, sample) - value(before, sample)

    after = until(server, lambda f: delta(f, "vllm:request_prompt_tokens_count") >= 3)
    max_model_len = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    expected_bounds = {
        "vllm:request_prompt_tokens": one_two_five(max_model_len), "vllm:iteration_tokens_total": ITERATION_TOKENS,
        "vllm:inter_token_latency_seconds": INTER_TOKEN_S, "vllm:request_queue_time_seconds": REQUEST_PHASE_S,
        "vllm:request_prefill_time_seconds": REQUEST_PHASE_S, "vllm:request_decode_time_seconds": REQUEST_PHASE_S,
    }
    for name, bounds in expected_bounds.items():
        assert after[name][0] == "histogram", name
        assert bucket_bounds(after, name) == [*map(floatToGoString, bounds), "+Inf"], name
        assert {s.labels["model_name"] for s in after[name][1]} == {MODEL}, name
    assert delta(after, "vllm:request_prompt_tokens_count") == 3
    assert delta(after, "vllm:request_prompt_tokens_sum") == sum(prompt_tokens)
    assert delta(after, "vllm:iteration_tokens_total_sum") == sum(prompt_tokens) + sum(completion_tokens)
    assert delta(after, "vllm:iteration_tokens_total_count") >= 3 * BLOCK  # a step per decoded token, at least
    assert delta(after, "vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in completion_tokens)
    phases = {p: delta(after, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode")}
    for p in phases:
        assert delta(after, f"vllm:request_{p}_time_seconds_count") == 3, p
    e2e = delta(after, "vllm:e2e_request_latency_seconds_sum")
    assert phases["decode"] > 0 and phases["prefill"] > 0 and sum(phases.values()) <= e2e, (phases, e2e)
    # the decode gaps are the decode time, request by request
    assert delta(after, "vllm:inter_token_latency_seconds_sum") == pytest.approx(phases["decode"], rel=1e-6)


def test_preemptions_are_counted(server, client):
    """Three choices of one prompt (n=3: they run together from its prefill on) that L1 cannot
    hold together as they grow, 4 shared and 8 own blocks each against 16: the scheduler preempts
    one to let the others on, as often as it takes; vllm:num_preemptions_total counts each."""
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt=prompt(20, 4 * BLOCK), max_tokens=8 * BLOCK, n=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [len(c.text.split()) for c in out.choices] == [8 * BLOCK] * 3
    after = until(server, lambda f: value(f, "vllm:num_preemptions_total") > value(before, "vllm:num_preemptions_total"))
    assert after["vllm:num_preemptions"][0] == "counter"
    assert {s.labels["model_name"] for s in after["vllm:num_preemptions"][1]} == {MODEL}
    assert value(after, "vllm:num_preemptions_total") - value(before, "vllm:num_preemptions_total") >= 1
    assert value(after, "tierkv_preemptions_total") == value(after, "vllm:num_preemptions_total")
