"""tierkv-serve as a worker behind routers and benchmark clients: the routes besides OpenAI's, in
vLLM's and SGLang's shapes, unknown request fields, vLLM-named metrics, continuous usage, min_tokens.

One server for the module: the bundled SmolLM2 on the CPU under its default (hub id) name, with
an API key. A second, the tiny test model, refuses unknown fields and answers /get_load in
SGLang's shape. Each route's shape is checked against what the router or client reads
(vllm-router 0.1.17, sglang-router 0.3.2, vLLM's OpenAI server); tests/test_routers.py runs
the routers themselves over several replicas.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from load_helpers import tiny_model  # noqa: E402,F401  (module fixture: a tiny Llama with a tokenizer)
from server_helpers import free_port, metric, scrape, serving, settled  # noqa: E402

from tierkv.server.protocol import FOREIGN_FIELDS  # noqa: E402

KEY = "sk-test-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model's default name: its hub id
CONTEXT = 512
LABELS = f'engine="0",model_name="{MODEL}"'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "server.log"
    with serving(["--l1", "64MiB", "--max-model-len", str(CONTEXT)], log, env={"TIERKV_API_KEY": KEY}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    """The server's own tokenizer, from the directory /v1/models names."""
    from tierkv.engine.tokenizer import Tokenizer

    root = get(server, "/v1/models").json()["data"][0]["root"]
    return Tokenizer.from_dir(Path(root))


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.url + path, headers=AUTH, timeout=60, **kw)


def post(server, path: str, body=None, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def long_prefix() -> str:
    # fresh (the id first) and well over a few 16-token blocks, so nothing else cached it
    return f"Session {uuid.uuid4().hex}. " + "You answer questions about tiered caches briefly. " * 10


# ---------------------------------------------------------------------------- what is served


def test_models_name_the_hub_id_and_a_directory_with_the_tokenizer(server):
    (card,) = get(server, "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] == CONTEXT
    assert (Path(card["root"]) / "tokenizer.json").is_file()
    # GET /v1/models/{id} takes the id with its slash; an unknown one is a 404 in OpenAI's shape
    assert get(server, f"/v1/models/{MODEL}").json() == card
    r = get(server, "/v1/models/nope/none")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + f"/v1/models/{MODEL}", timeout=30).status_code == 401  # a /v1 route


def test_discovery_routes_in_sglangs_and_vllm_routers_shapes(server):
    info = get(server, "/get_server_info").json()
    assert get(server, "/server_info").json() == info  # SGLang's two names of one route
    # vllm-router's HTTP discovery: the model, this instance, and the block size it hashes prompts by
    assert info["model_id"] == MODEL and info["kv_block_size"] == 16 and info["instance_id"].startswith("tierkv-")
    # sglang-router's registration
    assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and info["max_model_len"] == CONTEXT
    model = get(server, "/get_model_info").json()
    assert get(server, "/model_info").json() == model
    assert model["model_path"] == MODEL and model["is_generation"] is True
    assert (Path(model["tokenizer_path"]) / "tokenizer.json").is_file()
    # open, as in vLLM (no key): routers call them without one
    assert httpx.get(server.url + "/get_server_info", timeout=30).status_code == 200


def test_head_answers_where_get_does(server):
    for path, headers in (("/health", {}), ("/metrics", {}), ("/v1/models", AUTH)):
        r = httpx.head(server.url + path, headers=headers, timeout=30)
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.head(server.url + "/v1/models", timeout=30).status_code == 401


# ---------------------------------------------------------------------------- tokens


def test_tokenize_and_detokenize_in_vllms_shape(server, tokenizer):
    text = "The capital of France is"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.json() == {"count": len(tokenizer.encode(text)), "max_model_len": CONTEXT,
                        "tokens": tokenizer.encode(text), "token_strs": None}
    # what vllm-router sends for a chat request: the chat template applied, generation prompt added
    messages = [{"role": "user", "content": "Name a color."}]
    r = post(server, "/tokenize", {"model": MODEL, "continue_final_message": False, "messages": messages})
    ids = tokenizer.apply_chat_template(messages)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False, "return_token_strs": True})
    assert r.json()["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert len(r.json()["token_strs"]) == r.json()["count"] and r.json()["token_strs"][0] == "<|im_start|>"
    assert post(server, "/detokenize", {"tokens": tokenizer.encode(text)}).json() == {"prompt": text}
    for body, status, param in [({"model": "other", "prompt": text}, 404, "model"),
                                ({"prompt": text, "messages": messages}, 400, "prompt"),
                                ({}, 400, "prompt"),
                                ({"messages": messages, "continue_final_message": True}, 400, "continue_final_message"),
                                ({"tokens": [10**6]}, 400, "tokens")]:
        r = post(server, "/detokenize" if "tokens" in body else "/tokenize", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)


def test_render_is_what_generation_runs(server, tokenizer):
    # vllm-router's cache_aware and kv_aware call these before every request, with the body the
    # client sent (and fields of their own); the token ids are the prompt the engine gets
    messages = [{"role": "user", "content": "Say something about caches."}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "min_tokens": 2,
            "no_stop_trim": False, "separate_reasoning": True, "return_hidden_states": False}
    rendered = post(server, "/v1/chat/completions/render", chat).json()
    assert rendered["token_ids"] == tokenizer.apply_chat_template(messages) and rendered["model"] == MODEL
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["features"] is None
    params = rendered["sampling_params"]
    assert params["max_tokens"] == 3 and params["min_tokens"] == 2 and params["temperature"] == 0
    done = post(server, "/v1/chat/completions", chat).json()
    assert done["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # no max_tokens: what the engine grants, the rest of the context
    rest = post(server, "/v1/chat/completions/render", {"model": MODEL, "messages": messages}).json()
    assert rest["sampling_params"]["max_tokens"] == CONTEXT - len(rendered["token_ids"])
    # completions: a list, one entry per prompt
    (item,) = post(server, "/v1/completions/render", {"model": MODEL, "prompt": "Hello there", "echo": False}).json()
    assert item["token_ids"] == tokenizer.encode("Hello there") and item["request_id"].startswith("cmpl-")
    # the same checks as generation: the context, the model, the key
    r = post(server, "/v1/completions/render", {"model": MODEL, "prompt": "word " * CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert post(server, "/v1/completions/render", {"model": "x", "prompt": "hi"}).status_code == 404
    assert post(server, "/v1/completions/render", {"model": MODEL, "prompt": "hi"}, headers={}).status_code == 401


# ---------------------------------------------------------------------------- unknown fields


def test_unknown_fields_are_counted_and_the_ones_that_change_results_refused(server, client):
    before = scrape(server)
    extra = {"no_stop_trim": False, "separate_reasoning": True, "continue_final_message": False,
             "some_new_field": {"x": 1}, "another": 3}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body=extra)
    assert r.usage.completion_tokens <= 2
    after = scrape(server)
    name = "tierkv_request_unknown_fields_total"
    for field, n in (("no_stop_trim", 1), ("separate_reasoning", 1), ("continue_final_message", 1), ("other", 2)):
        label = f'field="{field}"'
        assert metric(after, name, label) - metric(before, name, label) == n, field
    assert "some_new_field" not in after  # a label set of known names only
    # a field that would change the result is refused with its name, never ignored
    for field, value in (("logit_bias", {"50": 10}), ("no_stop_trim", True), ("continue_final_message", True),
                         ("response_format", {"type": "json_object"})):
        assert FOREIGN_FIELDS[field] is not None
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---------------------------------------------------------------------------- streaming, min_tokens


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    # guidellm always asks for it; vLLM sends it only with include_usage
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    parts = list(client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                           **kw))
    chunks, final = [p for p in parts if p.choices], parts[-1]
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert not final.choices and final.usage.completion_tokens == 5
    plain = list(client.completions.create(stream_options={"continuous_usage_stats": True}, **kw))
    assert all(p.usage is None for p in plain)


def test_min_tokens_holds_off_the_end(client):
    # token for token against transformers: tests/test_min_tokens.py
    messages = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 12
    n = free.usage.completion_tokens + 6
    held = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"min_tokens": n})
    assert held.usage.completion_tokens >= n
    # the tokens before the end the model wanted are the same (greedy): the text starts alike
    assert held.choices[0].message.content.startswith(free.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"min_tokens": 5})
    assert err.value.body["param"] == "min_tokens"


# ---------------------------------------------------------------------------- load, cache, health


def test_get_load_counts_what_runs(server):
    assert get(server, "/get_load").json() == {"load": 0}
    prompt = "Count: " + "one, two, three, " * 8  # full blocks, cached as soon as they are computed
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # it runs
        assert get(server, "/get_load").json()["load"] == 1
        (load,) = get(server, "/get_load?format=sglang").json()
        assert load["dp_rank"] == 0 and load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["num_tokens"] > 40
        # it holds its blocks: the cache is not emptied (aiperf and the routers retry a 409)
        r2 = post(server, "/flush_cache")
        assert r2.status_code == 409 and r2.json()["error"]["code"] == "cache_in_use"
    assert get(server, "/get_load?format=nope").status_code == 400


def test_flush_cache_and_reset_prefix_cache_empty_the_cache(server, client):
    system = long_prefix()

    def cached(question: str) -> int:
        r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens

    for path in ("/flush_cache", "/reset_prefix_cache"):  # SGLang's name, vLLM's name
        cached("What is L1?")
        assert cached("What is L2?") >= 64
        r = post(server, path)
        assert r.status_code == 200 and r.json() == {"flushed": True}
        assert cached("What is L2?") == 0
        stats = get(server, "/v1/cache/stats").json()["tiers"]["l1"]
        assert stats["used_blocks"] > 0  # the last request's own blocks, cached again since


def test_health_generate(server):
    r = httpx.get(server.url + "/health_generate", timeout=60)
    assert r.status_code == 200 and r.json() == {}


# ---------------------------------------------------------------------------- metrics


def test_vllm_named_metrics_read_the_same_measurements(server, client):
    system = long_prefix()
    for question in ("What is L1?", "What is L2?"):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    m = settled(server)
    same = [("vllm:num_requests_running", "tierkv_requests_running", ""),
            ("vllm:num_requests_waiting", "tierkv_requests_waiting", ""),
            ("vllm:prompt_tokens_total", "tierkv_prompt_tokens_total", ""),
            ("vllm:generation_tokens_total", "tierkv_generation_tokens_total", ""),
            ("vllm:prefix_cache_queries_total", "tierkv_prefix_cache_query_tokens_total", ""),
            ("vllm:time_to_first_token_seconds_count", "tierkv_time_to_first_token_seconds_count", ""),
            ("vllm:e2e_request_latency_seconds_sum", "tierkv_e2e_request_latency_seconds_sum", ""),
            ("vllm:request_time_per_output_token_seconds_count", "tierkv_time_per_output_token_seconds_count", ""),
            ("vllm:request_success_total", "tierkv_requests_finished_total", 'finished_reason="length"'),
            ("vllm:kv_cache_usage_perc", "tierkv_kv_cache_usage", ""),
            ("vllm:gpu_cache_usage_perc", "tierkv_kv_cache_usage", "")]
    for vllm_name, tierkv_name, extra in same:
        labels = f'engine="0",{extra},model_name="{MODEL}"' if extra else LABELS  # the exposition sorts labels
        assert metric(m, vllm_name, labels) == metric(m, tierkv_name, extra), vllm_name
    assert metric(m, "vllm:prompt_tokens_total", LABELS) > 0
    assert metric(m, "vllm:request_success_total", f'engine="0",finished_reason="length",model_name="{MODEL}"') >= 2
    hits = sum(metric(m, "tierkv_prefix_cache_hit_tokens_total", f'tier="{t}"') for t in ("l1", "l2", "l3"))
    assert metric(m, "vllm:prefix_cache_hits_total", LABELS) == hits >= 64
    assert 0 <= metric(m, "vllm:kv_cache_usage_perc", LABELS) <= 1
    info = next(line for line in m.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="' in info and info.endswith(" 1.0")


def test_hit_counters_agree_with_an_aborted_request_among_them(server, client):
    # Both count a request once its prompt has been looked up and computed, aborted later or not:
    # the cache counts hit tokens at the lookup, the server counts cached tokens at the first token.
    def counters() -> tuple[float, float]:
        m = settled(server)
        hits = sum(metric(m, "tierkv_prefix_cache_hit_tokens_total", f'tier="{t}"') for t in ("l1", "l2", "l3"))
        return hits, metric(m, "tierkv_cached_prompt_tokens_total")

    system = long_prefix()
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    hits0, cached0 = counters()
    client.chat.completions.create(model=MODEL, max_tokens=1, messages=msgs("What is L1?"))
    body = {"model": MODEL, "messages": msgs("What is L2?"), "max_tokens": 300, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/chat/completions", json=body,
                                                 headers=AUTH) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))  # a hit, then the client leaves
    hits, cached = counters()
    assert hits - hits0 == cached - cached0 >= 64


# ---------------------------------------------------------------------------- strict fields, SGLang's load


@pytest.fixture(scope="module")
def strict(tiny_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("strict") / "server.log"
    with serving(["--model", str(tiny_model), "--served-model-name", "tiny", "--l1", "4MiB", "--strict-request-fields",
                  "--load-format", "sglang"], log, env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


def test_strict_mode_refuses_unknown_fields_by_name(strict):
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 2}
    assert httpx.post(strict.url + "/v1/completions", json=body, timeout=60).status_code == 200
    for extra in ({"no_stop_trim": False}, {"some_new_field": 1}):
        r = httpx.post(strict.url + "/v1/completions", json={**body, **extra}, timeout=60)
        (field,) = extra
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "--strict-request-fields" in r.text
    r = httpx.post(strict.url + "/tokenize", json={"prompt": "w1", "extra": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"
    schemas = httpx.get(strict.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        assert schemas[name]["additionalProperties"] is False, name  # the schema says so too
    # --load-format sglang: SGLang's list by default, vLLM's on request
    (load,) = httpx.get(strict.url + "/get_load", timeout=30).json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert httpx.get(strict.url + "/get_load?format=vllm", timeout=30).json() == {"load": 0}
    assert json.loads(httpx.get(strict.url + "/v1/models", timeout=30).text)["data"][0]["id"] == "tiny"


# ---------------------------------------------------------------------------- the real routers, one worker


@contextlib.contextmanager
def router(module: str, args: list[str], log_path: Path):
    """vllm-router or sglang-router (`module`: its launch_router) on a free port; its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), "--prometheus-port", str(free_port()), *args]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_vllm_routers_cache_aware_renders_each_request_here(server, tmp_path):
    # before each request it asks the worker for the prompt's tokens: /render, and /tokenize only
    # when /render fails
    routes = ('route="/v1/completions/render",status="200"', 'route="/v1/chat/completions/render",status="200"',
              'route="/tokenize",status="200"')
    before = scrape(server)
    with router("vllm_router.launch_router", ["--worker-urls", server.url, "--policy", "cache_aware", "--api-key",
                                              KEY], tmp_path / "router.log") as url:
        via = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        assert via.completions.create(model=MODEL, prompt="Hello there", max_tokens=2).usage.completion_tokens == 2
        # greedy: two sampled tokens can decode to "" (special tokens are skipped, and a character
        # split across tokens is held back), which failed this once in a full run
        chat = via.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           temperature=0)
        assert chat.choices[0].message.content
    after = scrape(server)
    assert [metric(after, "tierkv_requests_total", r) - metric(before, "tierkv_requests_total", r) for r in routes] \
        == [1, 1, 0]


def test_sglang_router_reads_the_load_in_its_shape(strict, tmp_path):
    pytest.importorskip("sglang_router")
    with router("sglang_router.launch_router", ["--worker-urls", strict.url, "--policy", "cache_aware"],
                tmp_path / "router.log") as url:
        # it adds fields of its own to every request: what --strict-request-fields refuses (why it is off
        # by default)
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field", r.text
        # -1 is what it reports for a worker whose /get_load it cannot read
        assert httpx.get(url + "/get_loads", timeout=30).json()["workers"] == [{"worker": strict.url, "load": 0}]
        assert httpx.post(url + "/flush_cache", timeout=30).json()["workers_flushed"] == 1


def test_profiling_routes_exist_only_with_a_profile_dir(server):
    # tests/test_server_profile.py serves them; without --profile-dir no one can start a profile
    for path in ("/start_profile", "/stop_profile"):
        assert httpx.post(server.url + path, timeout=30).status_code == 404
