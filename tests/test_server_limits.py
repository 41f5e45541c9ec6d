"""tierkv-serve against hostile clients, over real loopback sockets (issue 18).

One server for the module, the bundled SmolLM2 on the CPU, with short deadlines (2 s) so that the
slow-client cases take seconds. Three parts: bounded requests (body size, field limits, JSON
nesting), slow and idle clients (header, body and send deadlines, the connection cap, keep-alive
limits), and hostile input (Unicode, cache_salt, API keys, malformed HTTP). After every test that
uses the server, it must answer /health and a normal request, and its RSS must stay within
RSS_BOUND_MIB of what it was after warm-up.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import uuid

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from server_helpers import ServerProcess, metric, raw_exchange, raw_json, rss_mib

KEY = "sk-test-" + uuid.uuid4().hex
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512
BODY_LIMIT = 512 * 1024  # --max-request-bytes (the derived default would be 1 MiB)
DEADLINE_S = 2.0  # --header-timeout, --body-timeout, --send-timeout, --keep-alive-timeout
MAX_CONNECTIONS = 600
KEEP_ALIVE_REQUESTS = 3
RSS_BOUND_MIB = 100  # reading the 200 MB body would take the server far past this
ANSWER_BOUND_S = 15.0  # a normal 4-token request under attack (about 1 s when the CPU is idle)
# The engine's torch ops on one thread, as tests/load_helpers.py runs its servers: on a 2-core box
# its OpenMP workers would otherwise share both cores with the clients these tests run, and the
# token gaps compared below would measure the clients' CPU rather than the server's handling.
ONE_CORE_ENGINE = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-limits") / "server.log"
    d = str(DEADLINE_S)
    srv = ServerProcess(["--served-model-name", MODEL, "--l1", "64MiB", "--max-model-len", str(CONTEXT),
                         "--max-num-seqs", "16", "--max-request-bytes", "512KiB", "--header-timeout", d,
                         "--body-timeout", d, "--send-timeout", d, "--keep-alive-timeout", d,
                         "--send-buffer-bytes", "8KiB", "--max-connections", str(MAX_CONNECTIONS),
                         "--max-keep-alive-requests", str(KEEP_ALIVE_REQUESTS)], log,
                        env={"TIERKV_API_KEY": KEY, **ONE_CORE_ENGINE})
    # one client for the module (building an SSL context per request costs ~50 ms); no pooled
    # connections, so that none is reused just as the server's keep-alive deadline closes it
    srv.http = httpx.Client(base_url=srv.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
    try:
        srv.wait_ready()
        normal_request(srv)
        srv.baseline_rss = rss_mib(srv.proc.pid)
        yield srv
    finally:
        srv.http.close()
        code = srv.stop()
    log_text = srv.log_path.read_text()
    assert code == 0, log_text
    assert "Traceback" not in log_text and KEY not in log_text


def normal_request(server) -> None:
    r = server.http.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.fixture(autouse=True)
def server_survives(request):
    """After each case: /health, a normal request, and RSS within the bound."""
    yield
    if "server" not in request.fixturenames:
        return
    server = request.getfixturevalue("server")
    assert server.http.get("/health").json() == {"status": "ok"}
    normal_request(server)
    grown = rss_mib(server.proc.pid) - server.baseline_rss
    assert grown < RSS_BOUND_MIB, f"the server's RSS grew {grown:.0f} MiB"


def post(server, body, path="/v1/completions", headers=AUTH, **kw) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, dict) else body  # or bytes, text, a generator
    return server.http.post(path, content=content, headers={"Content-Type": "application/json", **headers}, **kw)


def error_of(resp: httpx.Response, status: int, code: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


def request_bytes(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", server.port))
    return s


def scrape(server) -> str:
    return server.http.get("/metrics").text


def closed_by(server, reason: str) -> float:
    return metric(scrape(server), "tierkv_http_connections_closed_total", f'reason="{reason}"')


# ---------------------------------------------------------------------------- bounded requests


def test_a_content_length_over_the_limit_gets_413_before_the_body_is_sent(server):
    # the 200 MB body: only the headers go out, and the answer comes back at once
    with connect(server) as s:
        s.settimeout(10)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    status, body = raw_json(out)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in body["error"]["message"] and "--max-request-bytes" in body["error"]["message"]
    # the real client, sending a body just over the limit, sees the same answer
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * BODY_LIMIT, max_tokens=1)
    assert info.value.status_code == 413 and str(BODY_LIMIT) in info.value.message


def test_a_chunked_body_is_cut_off_at_the_limit(server):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(1024):  # 64 MiB offered, in 64 KiB chunks, with no Content-Length
            sent += 65536
            yield b" " * 65536

    r = post(server, chunks())
    assert str(BODY_LIMIT) in error_of(r, 413, "request_too_large")
    assert r.headers["connection"] == "close"  # the rest of the body is never parsed as a request
    assert sent < 64 * 1024 * 1024  # the server stopped taking it (loopback buffers hold a few MiB)


def test_a_body_under_the_limit_reaches_the_route(server):
    # about 400 KiB of prompt: read and tokenized, then refused for the context, not for its size
    r = post(server, {"model": MODEL, "prompt": "word " * 80_000, "max_tokens": 1})
    assert "context" in error_of(r, 400, "context_length_exceeded")


OVER_LONG = "word " * 100_000  # ~500 KB, under the body limit: 100,001 tokens against a context of 512
STREAM_TOKENS = 300  # a stream's chunks; STREAMS of them give ~400 gaps with the hostile client at work, ~470 without
# Streams run one after another while the client loops: a p99 of ~130 gaps (one stream) was its top
# two gaps, and one scheduling hiccup of the 2-core box in the loaded set failed the test (1.25x);
# with ~400 it is the fourth, and two hiccups in one set no longer decide it
STREAMS = 4
# The hostile client, a process of its own (in this one, its thread would hold the GIL that the
# thread timing the stream needs): until its stdin closes, on for 0.7 s, off for 0.8 s (the quiet
# gaps keep clear of its requests), POSTing each over-long body with a pause of 0.1 s. Refusing one
# costs the server ~2.5 ms of CPU (reading and parsing 500 KB) and the client about as much: with no
# pause, on a 2-core box, the two would keep a core busy, and the comparison would measure the box.
# It writes one JSON line a request to a file: [start, end, path, status, body] (time.monotonic()).
# Not to a pipe read at the end: the pipe's 64 KiB held ~195 lines, then the client blocked in
# print and loaded nothing for the rest of the run (CI's failing run had 194 answers).
HOSTILE_CLIENT = """
import json, os, sys, threading, time
import httpx
os.nice(19)  # its own CPU yields to the server and the stream's reader: only the server's handling of it is measured
url, key, log, bodies = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.stdin.readline())
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(base_url=url, timeout=60) as c, open(log, "w") as out:
    while not done.wait(0.8):
        phase = time.monotonic() + 0.7
        while time.monotonic() < phase and not done.is_set():
            for path, body in bodies:
                start = time.monotonic()
                r = c.post(path, content=body, headers={"Authorization": "Bearer " + key,
                                                        "Content-Type": "application/json"})
                print(json.dumps([start, time.monotonic(), path, r.status_code, r.text[:300]]), file=out, flush=True)
                time.sleep(0.1)
"""


def test_a_client_looping_over_long_prompts_does_not_stall_running_streams(server, tmp_path):
    """Issue 37 item 4. Each refused prompt was tokenized on the engine thread (~0.2 s for this one,
    ~0.5 s for 1 MiB), and /tokenize's 100,001 ids were encoded on the event loop: a client looping
    them stretched every running stream's token gaps to the length of one refusal (p99 3.5x the quiet
    one). Streams run while that client is switched on and off; their gaps during the client's requests
    are compared with their gaps while no request of the client was under way (the same streams, the
    same box). Here the loaded p99 is 1.03-1.06x the quiet one, with a CPU hog beside it or not; CI's
    2-core VM gave 1.25x and 1.23x, once each, between green runs of the same test. So a first
    measurement over the bound is taken again, fresh, and the bound holds for the second: a stall on
    the server's side fails both."""
    first = _stream_gaps_under_a_hostile_client(server, tmp_path / "first")
    if first["loaded"] <= 1.2 * first["quiet"]:
        return
    second = _stream_gaps_under_a_hostile_client(server, tmp_path / "second")
    assert second["loaded"] <= 1.2 * second["quiet"], (first, second)


def _stream_gaps_under_a_hostile_client(server, folder) -> dict[str, float]:
    """The p99 of the streams' token gaps while the hostile client's requests were under way
    ("loaded") and while none was near ("quiet"), with the counts and the client's answers checked."""
    bodies = [("/v1/completions", json.dumps({"model": MODEL, "prompt": OVER_LONG, "max_tokens": 1})),
              ("/tokenize", json.dumps({"model": MODEL, "prompt": OVER_LONG}))]
    folder.mkdir()
    log = folder / "hostile.jsonl"
    hostile = subprocess.Popen([sys.executable, "-c", HOSTILE_CLIENT, server.url, KEY, str(log)],
                               stdin=subprocess.PIPE, text=True)
    streams = []  # each stream's chunk arrival times
    try:
        hostile.stdin.write(json.dumps(bodies) + "\n")
        hostile.stdin.flush()
        for _ in range(STREAMS):
            arrivals = []
            with server.http.stream("POST", "/v1/completions", headers=AUTH, json={
                    "model": MODEL, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS,
                    "min_tokens": STREAM_TOKENS, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
            streams.append(arrivals)
    finally:
        hostile.communicate(timeout=120)  # closes its stdin: it stops
    answers = [json.loads(line) for line in log.read_text().splitlines()]
    busy = [(start, end) for start, end, *_ in answers]
    assert [len(a) for a in streams] == [STREAM_TOKENS] * STREAMS
    loaded, quiet = [], []  # gaps during which a hostile request was under way, and those with none near
    for arrivals in streams:
        for a, b in zip(arrivals, arrivals[1:]):
            if any(start < b and a < end for start, end in busy):
                loaded.append(b - a)
            elif not any(start < b + 0.1 and a - 0.1 < end for start, end in busy):
                quiet.append(b - a)
    assert len(loaded) >= 300 and len(quiet) >= 300, (len(loaded), len(quiet))  # enough of each for a p99
    for _, _, path, status, text in answers:  # each refused for the context, /tokenize too, from its length
        assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded", (path, text)
    return {"loaded": statistics.quantiles(loaded, n=100)[98], "quiet": statistics.quantiles(quiet, n=100)[98],
            "loaded_gaps": len(loaded), "quiet_gaps": len(quiet), "requests": len(answers)}


def test_an_over_long_prompt_is_refused_from_its_length_on_every_route_that_tokenizes(server):
    # 500,000 characters are at least 6,173 tokens for SmolLM2 (81 characters a token at most):
    # refused from the count of characters, before any tokenizing, chat templates and /tokenize too
    messages = [{"role": "user", "content": OVER_LONG}]
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": OVER_LONG, "max_tokens": 1}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}),
                       ("/tokenize", {"model": MODEL, "prompt": OVER_LONG}),
                       ("/tokenize", {"model": MODEL, "messages": messages}),
                       ("/v1/completions/render", {"model": MODEL, "prompt": OVER_LONG})]:
        message = error_of(post(server, body, path=path), 400, "context_length_exceeded")
        assert "the prompt has at least 617" in message and "context is 512 tokens" in message, (path, message)
    # under the bound, a prompt that does not fit is tokenized and refused with its exact count
    message = error_of(post(server, {"model": MODEL, "prompt": "word " * 1000, "max_tokens": 1}), 400)
    assert "the prompt has 1001 tokens" in message


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


FIELD_LIMITS = [  # (body, what the message must name)
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 items"),
    ({"stop": "x" * 513}, "at most 512 characters"),
    ({"stop": ["ok", "x" * 100_000]}, "at most 512 characters"),
    ({"stop": ""}, "at least 1 character"),
    ({"stop_token_ids": list(range(65))}, "at most 64 items"),
    ({"stop_token_ids": [2**64]}, "less than or equal to 9223372036854775807"),
    ({"cache_salt": "s" * 1025}, "at most 1024 characters"),
    ('{"model": "smol", "prompt": "hi", "user": ' + nested(32) + "}", "33 levels deep; the limit is 32"),
    ('{"model": "smol", "prompt": "hi", "user": ' + nested(100_000) + "}", "the limit is 32"),
    (nested(100_000), "the limit is 32"),
    ('{"model": "smol", "prompt": "hi", "seed": ' + "9" * 5000 + "}", "too many digits"),
]


@pytest.mark.parametrize("extra,names", FIELD_LIMITS, ids=[str(i) for i in range(len(FIELD_LIMITS))])
def test_each_field_limit_answers_an_error_that_names_it(server, extra, names):
    body = extra if isinstance(extra, str) else {"model": MODEL, "prompt": "hi", "max_tokens": 1, **extra}
    assert names in error_of(post(server, body), 400)


def test_limits_just_inside_are_served(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": ["x" * 512, "a", "b", "c"],
            "stop_token_ids": list(range(64)), "cache_salt": "s" * 1024}
    assert post(server, body).status_code == 200
    # 31 levels under the top-level object: valid JSON that the schema then refuses, not the depth check
    r = post(server, '{"model": "smol", "prompt": "hi", "user": ' + nested(31) + "}")
    assert "limit is 32" not in error_of(r, 400)


def test_models_reports_the_context_and_the_start_line_the_limits(server):
    assert server.http.get("/v1/models", headers=AUTH).json()["data"][0]["max_model_len"] == CONTEXT  # as vLLM
    assert ("limits: body 512.0 KiB, headers 2 s, body 2 s, stalled send 2 s (8.0 KiB buffer), keep-alive 2 s x 3 "
            f"requests, {MAX_CONNECTIONS} connections") in server.log()


def test_body_limit_default_and_flags():
    from tierkv.server.cli import load_options
    from tierkv.server.limits import default_max_request_bytes

    assert default_max_request_bytes(512) == 1024 * 1024  # the floor
    assert default_max_request_bytes(131072) == 8 * 1024 * 1024  # 64 bytes a token
    opts = load_options([])
    assert opts["max_request_bytes"] is None and opts["header_timeout"] == 10 and opts["max_connections"] == 1000
    assert load_options(["--max-request-bytes", "4MiB"])["max_request_bytes"] == 4 * 1024 * 1024
    for bad in (["--max-request-bytes", "lots"], ["--max-request-bytes", "1"], ["--header-timeout", "0"],
                ["--send-timeout", "-1"], ["--max-connections", "0"], ["--body-timeout", "inf"]):
        with pytest.raises(SystemExit):
            load_options(bad)


# ---------------------------------------------------------------------------- slow and idle clients


def test_500_idle_and_20_slow_loris_clients_while_a_normal_client_gets_answers(server):
    """Each attacker reconnects as soon as it is cut off, so the server holds about 520 hostile
    connections throughout; the openai client must still get every answer within ANSWER_BOUND_S,
    and each slow-loris connection must be cut off with a 408 after --header-timeout."""
    header = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    cut_after: list[float] = []
    answered: list[float] = []
    idle_closed: list[int] = []

    async def idle(stop: asyncio.Event):
        while not stop.is_set():
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                if await asyncio.wait_for(r.read(), DEADLINE_S + 3) == b"":  # the server closed it
                    idle_closed.append(1)
            except asyncio.TimeoutError:
                pass
            w.close()

    async def slow_loris(stop: asyncio.Event):
        while not stop.is_set():
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            start = time.monotonic()

            async def drip():
                for b in header:  # a byte every 0.25 s: the headers alone would take 15 s
                    w.write(bytes([b]))
                    await asyncio.sleep(0.25)

            dripping = asyncio.ensure_future(drip())
            try:
                reply = await r.read()  # until the server closes
            except ConnectionResetError:
                # cut off too: a server that closes a socket holding unread dripped bytes sends
                # a reset, which can discard its 408 before this side reads it (seen under load)
                reply = b""
            dripping.cancel()
            w.close()
            if reply:
                assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply, reply[:200]
                cut_after.append(time.monotonic() - start)

    async def normal_client():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=60) as client:
            for i in range(3):
                start = time.monotonic()
                r = await client.chat.completions.create(
                    model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"Say {i}."}])
                assert r.usage.completion_tokens >= 1
                answered.append(time.monotonic() - start)
                await asyncio.sleep(0.5)

    async def run():
        stop = asyncio.Event()
        attackers = [asyncio.ensure_future(idle(stop)) for _ in range(500)]
        attackers += [asyncio.ensure_future(slow_loris(stop)) for _ in range(20)]
        await asyncio.sleep(1.0)  # let the connections pile up
        open_during = metric(scrape(server), "tierkv_http_connections_open")
        await normal_client()  # about 5 s: every attacker is cut off and reconnects at least once
        stop.set()
        await asyncio.gather(*attackers)
        return open_during

    before = closed_by(server, "header_timeout")
    open_during = asyncio.run(run())
    assert open_during >= 400  # the attack was on while the client asked
    assert len(answered) == 3 and max(answered) < ANSWER_BOUND_S, answered
    assert len(cut_after) >= 20 and max(cut_after) < DEADLINE_S + 2, cut_after
    assert closed_by(server, "header_timeout") >= before + 20
    assert len(idle_closed) >= 500  # each idle connection was closed by the server, not by the client
    # none of them is held once the attack ends
    end = time.monotonic() + 10
    while time.monotonic() < end and metric(scrape(server), "tierkv_http_connections_open") > 5:
        time.sleep(0.2)
    assert metric(scrape(server), "tierkv_http_connections_open") <= 5


def test_a_slow_body_is_cut_off_with_408(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    start = time.monotonic()
    with connect(server) as s:
        s.sendall(request_bytes("/v1/completions", body)[:-len(body)])  # the headers, then a byte a second
        s.settimeout(1.0)
        out = b""
        for b in body:
            s.sendall(bytes([b]))
            try:
                out = s.recv(65536)
                break
            except TimeoutError:
                continue
    status, err = raw_json(out)
    assert status == 408 and err["error"]["code"] == "request_timeout" and "--body-timeout" in err["error"]["message"]
    assert time.monotonic() - start < DEADLINE_S + 2


def held_blocks(server) -> int:
    stats = server.http.get("/v1/cache/stats", headers=AUTH).json()["tiers"]["l1"]
    return stats["used_blocks"] - stats["evictable_blocks"]


def test_a_stream_nobody_reads_is_dropped_and_its_request_aborted(server):
    """The client sends a streaming request and never reads: once the 8 KiB send buffer has been
    full for --send-timeout, the connection is dropped, the request aborted, its KV blocks freed."""
    before = metric(scrape(server), "tierkv_requests_aborted_total")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                       "max_tokens": 400, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()  # about 2 KB per token event
    with connect(server, rcvbuf=4096) as s:
        s.sendall(request_bytes("/v1/chat/completions", body))
        end = time.monotonic() + 40  # 400 tokens would take about 45 s here
        while time.monotonic() < end:
            m = scrape(server)
            if metric(m, "tierkv_requests_aborted_total") > before:
                break
            time.sleep(0.3)
        m = scrape(server)
        assert metric(m, "tierkv_requests_aborted_total") == before + 1
        assert metric(m, "tierkv_http_connections_closed_total", 'reason="send_timeout"') >= 1
    end = time.monotonic() + 10
    while time.monotonic() < end and (held_blocks(server) or metric(scrape(server), "tierkv_requests_running")):
        time.sleep(0.2)
    assert held_blocks(server) == 0 and metric(scrape(server), "tierkv_requests_running") == 0


def test_the_connection_cap_answers_503_and_closes(server):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 10):
            socks.append(connect(server))
        time.sleep(0.5)
        refused = []
        for s in socks:
            s.setblocking(False)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            refused.append(data)
        assert len(refused) >= 10
        status, err = raw_json(refused[-1])
        assert status == 503 and err["error"]["code"] == "too_many_connections"
        assert str(MAX_CONNECTIONS) in err["error"]["message"] and "--max-connections" in err["error"]["message"]
    finally:
        for s in socks:
            s.close()
    # served again once the server has seen them close
    end = time.monotonic() + 10
    while time.monotonic() < end and server.http.get("/health").status_code != 200:
        time.sleep(0.1)


def read_response(s: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length, from a keep-alive socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_keep_alive_limits(server):
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as s:
        s.settimeout(10)
        replies = []
        for _ in range(KEEP_ALIVE_REQUESTS):
            s.sendall(get)
            replies.append(read_response(s))
        assert all(r.startswith(b"HTTP/1.1 200") for r in replies)
        assert b"connection: close" not in replies[0].lower()
        assert b"connection: close" in replies[-1].lower()
        assert s.recv(65536) == b""  # closed after the last allowed request
    with connect(server) as s:  # idle after one request: closed after --keep-alive-timeout
        s.settimeout(10)
        s.sendall(get)
        assert read_response(s).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert s.recv(65536) == b""
        assert time.monotonic() - start < DEADLINE_S + 2  # uvicorn's own default would be 5 s


# ---------------------------------------------------------------------------- hostile input

# lone surrogates can only be written as JSON escapes: they are sent as raw text
UNICODE = [  # (raw JSON body fields after "model", expected status)
    ('"prompt": "a\\ud800b"', 400),
    ('"prompt": "\\udfff"', 400),
    ('"prompt": "hi", "stop": "\\ud800"', 400),
    ('"prompt": "hi", "stop": ["ok", "\\udc00x"]', 400),
    ('"prompt": "a\\u0000b\\u0000"', 200),
    ('"prompt": "\\u202eabc\\u200f\\u200e\\u2066x\\u2069"', 200),  # RTL override, RLM, LRM, isolates
    ('"prompt": "\\ufeff\\u200d\\ud83d\\ude00 \\ud83c\\udff3\\ufe0f\\u200d\\ud83c\\udf08"', 200),  # BOM, ZWJ, emoji
    ('"prompt": "hi", "stop": ["\\u0000", "\\u202e", "\\ud83d\\ude00"]', 200),
    ('"prompt": "\\uffff\\ufffe\\ufffd"', 200),  # noncharacters and the replacement character
]


@pytest.mark.parametrize("fields,status", UNICODE, ids=[str(i) for i in range(len(UNICODE))])
def test_unicode_edge_cases(server, fields, status):
    r = post(server, '{"model": "smol", "max_tokens": 2, ' + fields + "}")
    if status == 200:
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["choices"][0]["text"], str)
    else:
        assert "surrogate" in error_of(r, 400, "invalid_unicode")


def test_unicode_in_chat_messages(server):
    r = post(server, '{"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": '
                     '"\\u202e\\u0000\\ud83d\\ude00"}]}', path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    r = post(server, '{"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": '
                     '[{"type": "text", "text": "\\ud800"}]}]}', path="/v1/chat/completions")
    error_of(r, 400, "invalid_unicode")
    # bytes that are not UTF-8 at all: said so, not taken for a number too long to parse
    r = post(server, b'{"model": "smol", "prompt": "\xff\xfe", "max_tokens": 1}')
    assert "not valid UTF-8" in error_of(r, 400, "invalid_unicode")


SALTS = [  # (cache_salt as raw JSON, expected status)
    ('""', 200), ('"a"', 200), ('"' + "s" * 1024 + '"', 200), ('"' + "\\u00e9" * 1024 + '"', 200),
    ('"' + "s" * 1025 + '"', 400), ('"' + "s" * 200_000 + '"', 400),
    ('"\\u0000"', 200), ('"\\u202etenant\\u200f"', 200), ('"\\ud83d\\ude00/../..\\\\;DROP"', 200),
    ('"\\ud800"', 400), ('123', 400), ('["a"]', 400), ('{"a": 1}', 400), ("null", 200),
]


@pytest.mark.parametrize("salt,status", SALTS, ids=[str(i) for i in range(len(SALTS))])
def test_cache_salt_of_every_size_and_odd_characters(server, salt, status):
    r = post(server, '{"model": "smol", "prompt": "Tell me", "max_tokens": 1, "cache_salt": ' + salt + "}")
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        error_of(r, 400)


def test_salts_that_differ_only_in_odd_characters_share_nothing(server):
    prompt = f"Session {uuid.uuid4().hex}. " + "A shared prefix about caches. " * 4  # two blocks or more

    def cached(salt: str) -> int:
        r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("t\u202e") == 0
    assert cached("t\u202e") > 0  # the same salt hits
    assert cached("t\u200f") == 0 and cached("t") == 0 and cached("t\u0000") == 0


WRONG_KEYS = [
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Token {KEY}"},
    {"Authorization": f"Bearer  {KEY}"},  # two spaces
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Bearer {KEY.upper()}"},
    {"Authorization": "Bearer"},
    {"Authorization": KEY},
    {"Authorization": "Bearer " + "k" * 12_000},
    {"Authorization": b"Bearer \xe9\xe8"},  # latin-1 bytes in the header
    {"X-API-Key": KEY},
    {"api-key": KEY},
]


@pytest.mark.parametrize("headers", WRONG_KEYS, ids=[str(i) for i in range(len(WRONG_KEYS))])
def test_api_keys_in_wrong_schemes_are_refused(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
        r = server.http.request(method, path, headers=headers,
                                content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}))
        assert error_of(r, 401, "invalid_api_key")
        assert KEY not in r.text
    r = server.http.get("/v1/models", params={"api_key": KEY})  # a key in the URL
    error_of(r, 401, "invalid_api_key")


MALFORMED_HTTP = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 17_000,  # past 16 KiB and no end of headers
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad\x00Name: 1\r\n\r\n",
]


@pytest.mark.parametrize("data", MALFORMED_HTTP, ids=[str(i) for i in range(len(MALFORMED_HTTP))])
def test_malformed_http_gets_a_json_400(server, data):
    status, err = raw_json(raw_exchange(server.port, data))
    assert status == 400 and err["error"]["code"] == "invalid_http"
