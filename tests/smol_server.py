"""The SmolLM2 server that test_server.py and test_server_input.py each start one of (a module
fixture, `start`): its API key, served name and context, and the helpers to post to it and to check an
OpenAI-shaped error. Only helpers; no test here.
"""

from __future__ import annotations

import json
import uuid

import httpx
from server_helpers import serving

KEY = "sk-test-" + uuid.uuid4().hex
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512
VOCAB = 49152  # SmolLM2's vocabulary


def start(tmp_path_factory):
    """The server, for a module fixture to yield from: `yield from start(tmp_path_factory)`."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(["--served-model-name", MODEL, "--l1", "64MiB", "--max-model-len", str(CONTEXT), "--max-num-seqs",
                  "64", "--max-waiting", "128"], log, env={"TIERKV_API_KEY": KEY}) as srv:
        yield srv


def post(server, path: str, body, headers=AUTH, timeout=120, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **headers}, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if param is not None:
        assert err["param"] == param
    return err


def still_answers(server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
