"""What an operator reads off a real tierkv-serve: /metrics against what the requests did, the
request id (X-Request-Id) and the one log line per request.

One server for the module: the tiny word-level model (tests/load_helpers.py: token i is the
word "w{i}", so a prompt's token count is its word count), an L1 of 16 blocks so that three
growing requests preempt one another, an L2 and a disk L3 written through, so that hits come from
each tier; an API key, which must never reach the log. Driven by the real openai client; /metrics
is parsed with prometheus_client's own text parser, as Prometheus and production-stack's router
read it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from load_helpers import BLOCK, BLOCK_BYTES, MODEL, SERVER_ENV, tiny_model  # noqa: F401  (tiny_model: a fixture)
from server_helpers import raw_exchange, serving
from tierkv.engine.stats import INTER_TOKEN_S, ITERATION_TOKENS, REQUEST_PHASE_S, one_two_five

openai = pytest.importorskip("openai")

L1_BLOCKS = 16
KEY = "sk-observability-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("observability")
    with serving(["--model", str(tiny_model), "--served-model-name", MODEL, "--l1", str(L1_BLOCKS * BLOCK_BYTES),
                  "--l2", str(64 * BLOCK_BYTES), "--l3", f"file://{tmp / 'l3'}?size=64MiB",
                  "--write-policy", "write_through", "--log-level", "info"], tmp / "serve.log",
                 env={**SERVER_ENV, "TIERKV_API_KEY": KEY}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


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
    max_model_len = client.models.list().data[0].max_model_len
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


def test_engine_time_series_count_the_steps_of_a_request(server, client):
    """One request alone: its prompt in one mixed step, a decode step per later token, each step
    a batch of one; the engine thread's phases add up to no more than the wall time."""
    before = scrape(server)
    t = time.monotonic()
    out = complete(client, prompt(900, 2 * BLOCK + 1), 8)
    wall = time.monotonic() - t
    assert out.usage.completion_tokens == 8

    def delta(families, sample, **labels):
        return value(families, sample, **labels) - value(before, sample, **labels)

    batch = "tierkv_engine_step_batch_size"
    after = until(server, lambda f: delta(f, batch + "_count", kind="decode") >= 7)
    assert after[batch][0] == "histogram"
    steps = {k: delta(after, batch + "_count", kind=k) for k in ("mixed", "decode")}
    assert steps == {"mixed": 1, "decode": 7}
    assert sum(delta(after, batch + "_sum", kind=k) for k in steps) == 8  # one request in each step
    assert delta(after, batch + "_bucket", kind="decode", le="1.0") == 7  # (buckets are cumulative)
    assert delta(after, batch + "_bucket", kind="decode", le="+Inf") == 7
    phases = ("schedule", "launch", "wait", "postprocess")
    assert sorted(s.labels["phase"] for s in after["tierkv_engine_host_seconds"][1]
                  if s.name.endswith("_total")) == sorted(phases)
    host = {p: delta(after, "tierkv_engine_host_seconds_total", phase=p) for p in phases}
    assert host["wait"] == 0.0  # on a CPU a launched step is done when run returns
    assert all(host[p] > 0 for p in ("schedule", "launch", "postprocess")) and sum(host.values()) <= wall, (host, wall)
    # the GPU's seconds, by kind: a counter for each (0 on a CPU, where no step is timed), and no
    # step of this cold request waited for a load
    kind, samples = after["tierkv_engine_gpu_seconds"]
    assert kind == "counter" and sorted(s.labels["kind"] for s in samples if s.name.endswith("_total")) == [
        "decode", "mixed"]
    assert delta(after, "tierkv_engine_load_wait_steps_total") == 0
    # nothing waited for L1 room: nothing was warmed
    assert after["tierkv_warmed_blocks"][0] == "counter" and delta(after, "tierkv_warmed_blocks_total") == 0


def test_preemptions_are_counted(server, client):
    """Three choices of one prompt (n=3: they run together from its prefill on) that L1 cannot
    hold together as they grow, 4 shared and 8 own blocks each against 16: the scheduler preempts
    one to let the others on, as often as it takes; vllm:num_preemptions_total counts each."""
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt=prompt(20, 4 * BLOCK), max_tokens=8 * BLOCK, n=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [len(c.text.split()) for c in out.choices] == [8 * BLOCK] * 3
    preempted = value(before, "vllm:num_preemptions_total")
    after = until(server, lambda f: value(f, "vllm:num_preemptions_total") > preempted)
    assert after["vllm:num_preemptions"][0] == "counter"
    assert {s.labels["model_name"] for s in after["vllm:num_preemptions"][1]} == {MODEL}
    assert value(after, "vllm:num_preemptions_total") - value(before, "vllm:num_preemptions_total") >= 1
    assert value(after, "tierkv_preemptions_total") == value(after, "vllm:num_preemptions_total")


# ---------------------------------------------------------------------------- the request id and its log line

# tierkv/server/request_log.py's line, logfmt-style
LINE = re.compile(r"request id=(?P<id>\S+) finish=(?P<finish>\w+) prompt_tokens=(?P<prompt>\d+) "
                  r"cached_tokens=(?P<cached>\d+) cached_l1=(?P<l1>\d+) cached_l2=(?P<l2>\d+) cached_l3=(?P<l3>\d+) "
                  r"generated_tokens=(?P<generated>\d+) ttft_s=(?P<ttft>[\d.]+|-) total_s=(?P<total>[\d.]+)$")


def lines_of(server, request_id: str) -> list[dict]:
    """The log lines of the request whose X-Request-Id was `request_id`."""
    found = [m.groupdict() for line in server.log().splitlines() if (m := LINE.search(line))]
    return [f for f in found if f["id"] == f"cmpl-{request_id}"]


def test_x_request_id_names_the_request_and_comes_back(client):
    """As in vLLM, X-Request-Id is the request's id: the completion's id is cmpl-<id>, streamed
    chunks too; the response's X-Request-Id header says it. Two requests sent with one id both run.
    Without one, the server makes an id and says which."""
    rid = f"trace-{uuid.uuid4().hex}"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt(1, 8), max_tokens=2,
                                                      extra_headers={"X-Request-Id": rid})
    assert raw.headers["x-request-id"] == rid and raw.parse().id == f"cmpl-{rid}"
    with client.completions.with_streaming_response.create(model=MODEL, prompt=prompt(1, 8), max_tokens=2,
                                                           stream=True, extra_headers={"X-Request-Id": rid}) as resp:
        assert resp.headers["x-request-id"] == rid
        assert {chunk.id for chunk in resp.parse()} == {f"cmpl-{rid}"}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=prompt(10 + i, 8), max_tokens=8, extra_headers={"X-Request-Id": rid}), range(2)))
    assert [o.id for o in outs] == [f"cmpl-{rid}"] * 2
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt(1, 8), max_tokens=2)
    made = raw.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and raw.parse().id == f"cmpl-{made}"


def test_one_log_line_per_request_with_the_tier_of_each_hit(server, client):
    """Each request logs one INFO line: its id, prompt, cached and generated tokens, the tier its
    cached tokens came from, TTFT and total time. The same 65-token prompt computed, then found in
    L1, then (L1 and L2 emptied) read up from L3, then (pushed out of L1 by other prompts) loaded
    from L2."""
    text = prompt(300, 4 * BLOCK + 1)  # a hit is 4 whole blocks: the last token is computed

    def ask(tag: str, words: str = text, max_tokens: int = 2) -> str:
        rid = f"{tag}-{uuid.uuid4().hex[:8]}"
        complete_with_id(client, words, max_tokens, rid)
        return rid

    written = value(scrape(server), "tierkv_tier_blocks_in_total", tier="l3")
    cold, warm = ask("cold"), ask("l1")
    # write-through: the prompt's 4 blocks reach L3; then /flush_cache empties L1 and L2, not L3
    until(server, lambda f: value(f, "tierkv_tier_blocks_in_total", tier="l3") >= written + 4)
    # and none of them waits for room in L2 to go on (write-through's backlog, exported as a gauge)
    families = scrape(server)
    assert [s.value for s in families["tierkv_l3_write_backlog_blocks"][1]] == [0.0]
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    from_l3 = ask("l3")
    for i in range(3):  # 15 blocks of other prompts: L1 (16) lets the oldest go, to L2
        ask("filler", prompt(1 + 80 * i, 5 * BLOCK), 1)
    from_l2 = ask("l2")
    lines = {rid: lines_of(server, rid) for rid in (cold, warm, from_l3, from_l2)}
    assert all(len(found) == 1 for found in lines.values()), lines
    lines = {rid: {k: v if k in ("id", "finish", "ttft") else int(v) if k != "total" else float(v)
                   for k, v in found[0].items()} for rid, found in lines.items()}
    for line in lines.values():
        assert line["finish"] == "length" and line["prompt"] == 4 * BLOCK + 1 and line["generated"] == 2, line
        assert line["l1"] + line["l2"] + line["l3"] == line["cached"], line
        assert 0 < float(line["ttft"]) <= line["total"], line
    assert lines[cold]["cached"] == 0
    assert lines[warm]["cached"] == lines[warm]["l1"] == 4 * BLOCK
    assert lines[from_l3]["cached"] == lines[from_l3]["l3"] == 4 * BLOCK
    assert lines[from_l2]["cached"] == 4 * BLOCK and lines[from_l2]["l2"] > 0
    # an id that holds the API key is still logged, the key masked
    rid = f"oops-{KEY}"
    complete_with_id(client, text, 1, rid)
    assert KEY not in server.log() and "id=cmpl-oops-*** finish=" in server.log()


def complete_with_id(client, words: str, max_tokens: int, request_id: str):
    return client.completions.create(model=MODEL, prompt=words, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": request_id})


@pytest.mark.parametrize("bad", ["x" * 257, "two words", "tab\there", "caf\xe9"])
def test_an_unusable_request_id_is_refused_and_never_logged(server, bad):
    """A request id longer than 256 characters, or with anything but printable ASCII (a space, a
    tab, a byte past ASCII; h11 refuses control characters itself), gets a 400 that says what to
    send, under an id of the server's own, and reaches neither the log nor the response."""
    body = b'{"model": "%s", "prompt": "w1 w2", "max_tokens": 1}' % MODEL.encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nX-Request-Id: " + bad.encode("latin-1") +
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    response = raw_exchange(server.port, head + body)
    status_line, _, rest = response.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert status_line.split()[1] == b"400", response[:300]
    err = json.loads(payload)["error"]
    assert err["code"] == "invalid_request_id" and err["param"] == "X-Request-Id" and "X-Request-Id" in err["message"]
    made = dict(line.split(b": ", 1) for line in headers.split(b"\r\n"))[b"x-request-id"]
    assert re.fullmatch(rb"[0-9a-f]{32}", made)
    assert bad not in server.log() and bad.encode("latin-1") not in response
