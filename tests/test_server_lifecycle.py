"""tierkv-serve's life as a process, beside test_server.py's one shared server: overload answered
with 429 and a SIGTERM that drains the streams, flushes write-back blocks to a disk L3 and exits 0
(a server of its own); the config file and flags; secrets kept out of the log.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
from server_helpers import ServerProcess, l3_objects_all_decode, metric

MODEL = "smol"


# ---------------------------------------------------------------------------- load and shutdown


def test_overload_429_then_sigterm_drains_flushes_and_exits_0(tmp_path):
    l3 = tmp_path / "l3"
    srv = ServerProcess(["--served-model-name", MODEL, "--l1", "16MiB", "--l2", "16MiB",
                         "--l3", f"file://{l3}?size=1GiB", "--write-policy", "write_back",
                         "--max-num-seqs", "2", "--max-waiting", "2", "--grace-period", "2",
                         "--max-model-len", "256"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        body = {"model": MODEL, "prompt": "Tell me a long story about a cache. " * 4, "max_tokens": 200,
                "ignore_eos": True, "stream": True}

        async def one(c):
            async with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.headers.get("retry-after"), r.json(), []
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                return 200, None, None, events

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(one(c)) for _ in range(8)]
                # SIGTERM once the admitted requests are generating
                while True:
                    m = (await c.get(srv.url + "/metrics")).text
                    if metric(m, "tierkv_requests_running") >= 1 and metric(m, "tierkv_generation_tokens_total") == 0:
                        stats = (await c.get(srv.url + "/v1/cache/stats")).json()
                        if stats["stored_blocks"] >= 2:
                            break
                    await asyncio.sleep(0.2)
                srv.terminate()
                return await asyncio.gather(*tasks)

        results = asyncio.run(burst())
        rejected = [r for r in results if r[0] == 429]
        assert rejected, [r[0] for r in results]
        for _, retry_after, err, _ in rejected:
            assert int(retry_after) >= 1
            assert err["error"]["type"] == "rate_limit_error" and err["error"]["message"]
        served = [r for r in results if r[0] == 200]
        assert served and all(r[0] in (200, 429) for r in results)
        for *_, events in served:  # each stream ends cleanly: finished, or told it was cut short
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2][6:])
            assert "error" in last or last["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(120) == 0
    finally:
        code = srv.stop()
    log = srv.log_path.read_text()
    assert code == 0, log
    assert "Traceback" not in log
    assert l3_objects_all_decode(l3) >= 2  # write-back blocks reached L3 at shutdown, all intact
    assert not list(l3.rglob("*.tmp"))


def test_config_file_and_flags(tmp_path):
    from tierkv.server.cli import load_options

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9001\nl3:\n  - file:///tmp/x\nwrite-policy: write_back\nl1: 2GiB\n")
    opts = load_options(["--config", str(cfg), "--l1", "1GiB"])
    assert opts["port"] == 9001 and opts["l3"] == ["file:///tmp/x"] and opts["write_policy"] == "write_back"
    assert opts["l1"] == "1GiB" and opts["host"] == "127.0.0.1"
    assert opts["enforce_eager"] is False and load_options(["--enforce-eager"])["enforce_eager"] is True
    assert opts["enable_prefix_caching"] is True
    assert load_options(["--no-enable-prefix-caching"])["enable_prefix_caching"] is False
    cfg.write_text("prot: 1\n")
    with pytest.raises(SystemExit):
        load_options(["--config", str(cfg)])


def test_redaction_of_secrets(capfd):
    import logging

    from tierkv.server.cli import Redact, _setup_logging, redact_url

    r = Redact(["sk-abc"])
    assert r.scrub("key sk-abc, l3 redis://user:hunter2@host:6379/0") == "key ***, l3 redis://user:***@host:6379/0"
    assert redact_url("s3://bucket/p?endpoint=http://h:1") == "s3://bucket/p?endpoint=http://h:1"

    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers = [logging.StreamHandler()]  # what basicConfig would install in the server process
    try:
        _setup_logging("info", ["sk-xyz"])
        logging.getLogger("tierkv.engine.engine").warning("L3 %s key %s", ["redis://u:pw9@h:1/0"], "sk-xyz")
        err = capfd.readouterr().err
    finally:
        root.handlers = saved
    assert "redis://u:***@h:1/0" in err and "pw9" not in err and "sk-xyz" not in err
