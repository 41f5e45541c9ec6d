"""tierkv-serve end to end: a real server process on loopback, the bundled SmolLM2 on the CPU.

One server for the module (API key set, context 512: smol_server.py); the server's life as a
process (overload, SIGTERM, config, secrets in its log) is test_server_lifecycle.py's, bad input and the
OpenAPI schema against what it takes test_server_input.py's. Outputs are short
(max_tokens <= 8) to keep the module to a few minutes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from server_helpers import metric
import smol_server
from smol_server import AUTH, KEY, MODEL, assert_error, post, still_answers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from smol_server.start(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ---------------------------------------------------------------------------- the openai client


def test_openai_client_chat_and_completions(client):
    msgs = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and text
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens > 5 and chat.usage.prompt_tokens_details.cached_tokens >= 0
    parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert parts[-1].usage.completion_tokens == 6 and parts[-1].usage.prompt_tokens == chat.usage.prompt_tokens

    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 5
    parts = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text
    # the extras pass through the client's extra_body
    ext = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0.7,
                                    extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                                "ignore_eos": True, "priority": 3})
    assert ext.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_x_request_id_names_a_chat_request(client):
    """vLLM's rule for chat: the id is chatcmpl-<X-Request-Id>, streamed or not, and the response's
    X-Request-Id header says it (tests/test_server_observability.py: completions, the log line)."""
    rid = f"chat-{uuid.uuid4().hex}"
    msgs = [{"role": "user", "content": "Say hi."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2,
                                                           extra_headers={"X-Request-Id": rid})
    assert raw.headers["x-request-id"] == rid and raw.parse().id == f"chatcmpl-{rid}"
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=msgs, max_tokens=2, stream=True,
                                                                extra_headers={"X-Request-Id": rid}) as resp:
        assert resp.headers["x-request-id"] == rid
        assert {chunk.id for chunk in resp.parse()} == {f"chatcmpl-{rid}"}


def test_n_choices_share_the_prompt_and_each_equals_its_seed(client):
    # n=3 in one request: choice i is what n=1 with seed 7 + i gives; the prompt counts once
    msgs = [{"role": "user", "content": f"Tell me a story ({uuid.uuid4().hex[:6]})."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, extra_body={"top_k": 40, "ignore_eos": True})
    many = client.chat.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=7 + i, **kw) for i in range(3)]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in many.choices}) > 1  # distinct seeds, distinct choices
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == 18 and many.usage.total_tokens == many.usage.prompt_tokens + 18
    # streamed: every chunk names its choice; the text per index is the same, usage at the end once
    parts = list(client.chat.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True},
                                                **kw))
    texts, roles, reasons = {}, {}, {}
    for p in parts:
        for c in p.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            roles.setdefault(c.index, c.delta.role)
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert texts == {c.index: c.message.content for c in many.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"} and set(reasons.values()) == {"length"}
    assert [p.usage is not None for p in parts].count(True) == 1 and parts[-1].usage.completion_tokens == 18
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=4, temperature=0)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text  # greedy


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' SmolLM2 on the weights the server converted (same directory, fp32 CPU)."""
    import torch
    import transformers

    from tierkv.engine.loader import bundled_model_dir
    from tierkv.engine.tokenizer import Tokenizer

    path = bundled_model_dir(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, Tokenizer.from_dir(path)  # the server's own tokenizer: the same prompt ids


def hf_greedy_logprobs(hf_smollm, ids: list[int], steps: int) -> tuple[list[int], list[list[float]]]:
    """transformers' greedy tokens after `ids` and the sorted log-probabilities at each step."""
    import torch

    model, _ = hf_smollm
    tokens, sorted_lps = [], []
    with torch.inference_mode():
        for _ in range(steps):
            lp = torch.log_softmax(model(torch.tensor([ids + tokens])).logits[0, -1].float(), -1)
            tokens.append(int(lp.argmax()))
            sorted_lps.append(lp.sort(descending=True).values[:5].tolist())
    return tokens, sorted_lps


def test_completion_logprobs_match_transformers(client, hf_smollm):
    _, tok = hf_smollm
    prompt = "The capital of France is"
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    ids, expected = hf_greedy_logprobs(hf_smollm, tok.encode(prompt), 5)
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids] and "".join(lp.tokens) == comp.choices[0].text
    assert lp.token_logprobs == pytest.approx([e[0] for e in expected], abs=1e-3)
    for top, exp in zip(lp.top_logprobs, expected):
        assert len(top) <= 3 and sorted(top.values(), reverse=True) == pytest.approx(exp[: len(top)], abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # streamed: the same entries, offsets continuing across chunks
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}))
    got = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs is not None]
    assert sum((g.tokens for g in got), []) == lp.tokens
    assert sum((g.text_offset for g in got), []) == lp.text_offset
    assert sum((g.token_logprobs for g in got), []) == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs_in_openai_types_streamed_and_not(client, hf_smollm):
    from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

    _, tok = hf_smollm
    msgs = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(isinstance(c, ChatCompletionTokenLogprob) for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    greedy, expected = hf_greedy_logprobs(hf_smollm, tok.apply_chat_template(msgs), 4)
    assert [c.token for c in content] == [tok.decode([i], skip_special_tokens=False) for i in greedy]
    assert [c.logprob for c in content] == pytest.approx([e[0] for e in expected], abs=1e-3)
    for c, exp in zip(content, expected):
        assert bytes(c.bytes).decode() == c.token
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(exp[:2], abs=1e-3)
        assert c.top_logprobs[0].token == c.token  # greedy: the sampled token is the most likely
    parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}))
    streamed = [c for p in parts if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    # no logprobs asked: none sent
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_cached_tokens_follow_the_prefix_and_the_salt(client):
    # a fresh long prefix (well over one 16-token block), so earlier tests cannot have cached it
    system = f"Session {uuid.uuid4().hex}. " + "You answer questions about tiered caches briefly. " * 12

    def ask(question: str, salt: str) -> int:
        r = client.chat.completions.create(
            model=MODEL, max_tokens=2, temperature=0, extra_body={"cache_salt": salt},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens

    assert ask("What is L1?", "tenant-a") == 0
    hit = ask("What is L2?", "tenant-a")
    assert hit >= 64 and hit % 16 == 0
    assert ask("What is L2?", "tenant-b") == 0  # same prompt, other tenant: nothing shared


def test_64_concurrent_streams_match_sequential_greedy(client, server):
    prompts = [f"List {i} fruits:" for i in range(4)]
    body = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    expected = {p: client.completions.create(prompt=p, **body).choices[0].text for p in prompts}

    async def one(aclient, prompt):
        text, reasons = "", []
        stream = await aclient.completions.create(prompt=prompt, stream=True, **body)
        async for part in stream:
            text += part.choices[0].text
            reasons.append(part.choices[0].finish_reason)
        return prompt, text, reasons[-1]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for prompt, text, reason in results:
        assert reason == "length"
        assert text == expected[prompt]


def test_each_streamed_token_arrives_in_the_step_that_sampled_it(client):
    # Under async scheduling (the server's default) each token once left a step late: the gaps
    # between chunks were one decode step each, then 0 between the last two. Relative to the
    # other gaps, for a loaded machine: the last one is a decode step too.
    arrivals = []
    for part in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}):
        if part.choices:
            arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) == 5
    assert gaps[-1] > 0.25 * statistics.median(gaps[:-1]), gaps


def test_tokens_without_text_get_a_chunk_each(client):
    # SmolLM2 answers this with an emoji split over three tokens: the first two are the start of
    # a UTF-8 sequence and have no text of their own. As in vLLM each still gets its chunk (text
    # or content ""), so that a client counts tokens and times the first one from the chunks.
    from tierkv.engine.loader import bundled_model_dir
    from tierkv.engine.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "List three emojis:"}]
    body = dict(model=MODEL, max_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chat = [p.choices[0].delta.content for p in client.chat.completions.create(messages=messages, **body)]
    ids = Tokenizer.from_dir(bundled_model_dir(None)).apply_chat_template(messages)
    text = [p.choices[0].text for p in client.completions.create(prompt=ids, **body)]
    assert chat == text == ["", "", "\N{GLOWING STAR}"]


# ---------------------------------------------------------------------------- stops

COUNT = "1, 2, 3, 4, 5, 6,"  # SmolLM2 goes on " 7, 8, 9, 10, ...": one token each for " ", "7", ","
COUNT_CHAT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]  # "1, 2, 3, ..., 10"
STOPS = [  # chat or not, the request's stop fields, and what vLLM answers (token 28 is ",")
    (False, {"stop": [", 9"]}, " 7, 8"),
    (False, {"stop": [", 9"], "include_stop_str_in_output": True}, " 7, 8, 9"),
    (False, {"stop_token_ids": [28]}, " 7"),
    (False, {"stop_token_ids": [28], "include_stop_str_in_output": True}, " 7,"),
    (True, {"stop": [", 4"]}, "1, 2, 3"),
    (True, {"stop": [", 4"], "include_stop_str_in_output": True}, "1, 2, 3, 4"),
    (True, {"stop_token_ids": [28]}, "1"),
    (True, {"stop_token_ids": [28], "include_stop_str_in_output": True}, "1,"),
]


def greedy_answer(client, chat: bool, stream: bool, **fields) -> tuple[str, str]:
    """Text and finish reason of one greedy answer to COUNT (or COUNT_CHAT), as the client gets it."""
    stop = fields.pop("stop", None)
    kw = dict(model=MODEL, temperature=0, max_tokens=20, stream=stream, extra_body=fields,
              **({"stop": stop} if stop else {}))
    resp = (client.chat.completions.create(messages=COUNT_CHAT, **kw) if chat
            else client.completions.create(prompt=COUNT, **kw))
    if not stream:
        choice = resp.choices[0]
        return choice.message.content if chat else choice.text, choice.finish_reason
    parts = [p.choices[0] for p in resp if p.choices]
    return "".join(p.delta.content or "" if chat else p.text for p in parts), parts[-1].finish_reason


def test_stops_cut_the_text_as_vllm_does(client):
    # a stop string is cut whole though it began tokens before the one completing it; the text of
    # a stopping token is left out; include_stop_str_in_output keeps either; streamed or not
    assert greedy_answer(client, False, False)[0].startswith(" 7, 8, 9, 10")
    assert greedy_answer(client, True, False)[0].startswith("1, 2, 3, 4, 5")
    for chat, fields, want in STOPS:
        for stream in (False, True):
            assert greedy_answer(client, chat, stream, **fields) == (want, "stop"), (chat, fields, stream)


# ---------------------------------------------------------------------------- cancellation, metrics


def held_blocks(server) -> int:
    stats = httpx.get(server.url + "/v1/cache/stats", headers=AUTH, timeout=30).json()["tiers"]["l1"]
    return stats["used_blocks"] - stats["evictable_blocks"]


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = metric(httpx.get(server.url + "/metrics").text, "tierkv_requests_aborted_total")
    body = {"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: {") for line in got)
            assert held_blocks(server) > 0  # it runs and holds its blocks
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = httpx.get(server.url + "/metrics").text
        if metric(m, "tierkv_requests_running") == 0 and held_blocks(server) == 0:
            break
        time.sleep(0.2)
    m = httpx.get(server.url + "/metrics").text
    assert metric(m, "tierkv_requests_running") == 0 and held_blocks(server) == 0
    assert metric(m, "tierkv_requests_aborted_total") == before + 1


def test_client_gone_before_a_non_streaming_answer_aborts_it(server):
    before = metric(httpx.get(server.url + "/metrics").text, "tierkv_requests_aborted_total")
    body = {"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=2.0)  # gives up and closes the connection
    # the abort is counted when the handler sees the client gone, and carried out when the
    # engine thread takes the queued command: wait for both
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = httpx.get(server.url + "/metrics").text
        if (metric(m, "tierkv_requests_aborted_total") >= before + 1 and metric(m, "tierkv_requests_running") == 0
                and held_blocks(server) == 0):
            break
        time.sleep(0.2)
    m = httpx.get(server.url + "/metrics").text
    assert metric(m, "tierkv_requests_aborted_total") == before + 1
    assert metric(m, "tierkv_requests_running") == 0 and held_blocks(server) == 0


def test_metrics_report_requests_latencies_and_cache(server):
    still_answers(server)
    # a refusal of its own to count (the bad-input tests are test_server_input.py's, on another server)
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}), 400)
    m = httpx.get(server.url + "/metrics", timeout=30).text
    assert metric(m, "tierkv_requests_total", 'route="/v1/completions",status="200"') >= 1
    assert metric(m, "tierkv_requests_total", 'route="/v1/completions",status="400"') >= 1
    for name in ("tierkv_time_to_first_token_seconds_count", "tierkv_e2e_request_latency_seconds_count",
                 "tierkv_time_per_output_token_seconds_count", "tierkv_prefix_cache_queries_total"):
        assert metric(m, name) >= 1, name
    assert metric(m, "tierkv_prefix_cache_hit_tokens_total", 'tier="l1"') >= 64  # the cached-prefix test
    assert metric(m, "tierkv_tier_bytes_in_total", 'tier="l1"') > 0
    for name in ("tierkv_requests_waiting", "tierkv_tier_evictions_total", "tierkv_tier_errors_total"):
        assert name in m
    stats = httpx.get(server.url + "/v1/cache/stats", headers=AUTH, timeout=30).json()
    assert stats["queries"] >= 1 and stats["tiers"]["l1"]["capacity_blocks"] > 0


def test_queue_gauges_are_current_during_a_step(server):
    """A CPU step over several prompts takes a second or more. Scraped during it, the running and
    waiting gauges say which requests that step admitted: before, they kept what the last step's
    end left (every request waiting, none running) until the step was over."""
    n, first_token, seen = 8, threading.Event(), []

    def ask(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Request {i}. " + "A cache keeps what was computed once. " * 25,
                "max_tokens": 2, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] is not None:
                    first_token.set()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    while not first_token.is_set():
        m = httpx.get(server.url + "/metrics", timeout=30).text
        if first_token.is_set():
            break  # this scrape may have come after the step
        seen.append((metric(m, "tierkv_requests_running"), metric(m, "tierkv_requests_waiting")))
        time.sleep(0.02)
    for th in threads:
        th.join()
    assert seen and max(running for running, _ in seen) > 0, seen
    assert all(running + waiting <= n for running, waiting in seen), seen


def test_bench_serving_sweeps_an_external_server(server, tmp_path):
    """--url: a two-point multi-round sweep against one external server. The bundled model has a
    tokenizer, so answers come back as text and histories take the seeded stand-ins; with an SLO
    no CPU misses, the rate doubles."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_serving

    [path] = bench_serving.main(["--url", server.url, "--api-key", KEY, "--smoke", "--workloads", "multi_round",
                                 "--start-rate", "2", "--point-seconds", "2", "--drain-seconds", "30", "--slo", "600",
                                 "--no-plot", "--out", str(tmp_path)])
    assert KEY not in path.read_text()
    run = json.loads(path.read_text())["configs"]["external"]
    points = run["points"]
    assert [p["offered_rate"] for p in points] == [2.0, 4.0] and run["goodput"]["requests_per_s"] == 4.0
    for p in points:
        assert p["arrivals"] > 0 and p["completed"] == p["arrivals"], p["error_examples"]
        assert p["slo_held"] and p["p99_ttft_ms"] > 0 and p["itl_ms"]["p50"] > 0
        assert p["cache"]["l1"]["hit_tokens"] > 0 and p["cached_tokens"] > 0  # each round re-sends its history
        assert p["bound"]["seconds"]["compute"] > 0 and p["bound"]["binding"] == "compute"  # no L2, no disk
    assert run["answers"] == {"returned": 0, "stand_in": sum(p["completed"] for p in points)}
    assert run["prime"]["prompts"] == 8 and run["prime"]["errors"] == 0 and run["cold_probe"]["s_per_token"] > 0


def test_no_secret_in_the_log(server):
    still_answers(server)
    log = server.log()
    assert "Started server process" in log or "Uvicorn running" in log
    assert KEY not in log
