"""Hub model ids ("org/name"), without the internet: a fake Hugging Face Hub on a loopback port.

The fake hub is a real HTTP server (stdlib http.server in a thread) answering the routes that
huggingface_hub's snapshot_download uses: model info, the file tree, and HEAD/GET on resolve,
with the headers it needs (X-Repo-Commit, ETag, Content-Length) and the Hub's X-Error-Code on
errors. HF_ENDPOINT points at it; HF_HOME is a fresh directory per test. It serves a tiny
random-weight checkpoint next to .bin/.pth decoys, and logs every request, so tests can show
what was and was not fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import pytest

from load_helpers import tiny_model  # noqa: F401  (a module fixture: tiny Llama + word-level tokenizer)
from server_helpers import ServerProcess, free_port
from tierkv import LLM, SamplingParams
from tierkv.engine.loader import ModelLoadError

SHA = "1f0e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # the repo's commit: 40 hex, as the Hub sends
TOKEN = "hf_fake_token_for_tests"
# Files a snapshot must not fetch: pickles, a second copy of the weights, subfolders, docs.
DECOYS = {"pytorch_model.bin": b"PICKLE" * 100, "training_args.pth": b"PICKLE" * 10,
          "consolidated.safetensors": b"not ours", "onnx/model.safetensors": b"not ours", "README.md": b"# tiny"}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class FakeHub:
    """Repos from local directories. `gated`: files need an accepted license (401 anonymous,
    403 with a token, as the Hub answers); `private`: everything needs TOKEN, else 401
    RepoNotFound (the Hub does not say that a private repo exists)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated=(), private=()) -> None:
        self.repos, self.gated, self.private = repos, set(gated), set(private)
        self.log: list[tuple[str, str]] = []  # (method, path) of every request
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub.answer(self, body=True)

            def do_HEAD(self):
                hub.answer(self, body=False)

            def log_message(self, *args):  # keep pytest's output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fetched(self) -> set[str]:
        """Files whose bytes were sent (GET on resolve)."""
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.log if m == "GET" and "/resolve/" in p}

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.log.append((req.command, path))
        m = (re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
             or re.fullmatch(r"/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)", path))
        if m is None:
            return self.send(req, 404, b"", body)
        repo, route = m.group(1), m.group(2)
        authorized = req.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo not in self.repos or (repo in self.private and not authorized):
            status = 401 if repo in self.private else 404
            return self.send(req, status, b"", body, {"X-Error-Code": "RepoNotFound"})
        files = self.repos[repo]
        if route == "revision":
            info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": f} for f in files]}
            return self.send(req, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        if route == "tree":
            tree = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in files.items()]
            return self.send(req, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        if repo in self.gated:  # the Hub lists a gated repo's files but does not send them
            return self.send(req, 403 if req.headers.get("Authorization") else 401, b"", body,
                             {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"})
        name = m.group(4)
        if name not in files:
            return self.send(req, 404, b"", body, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA})
        data = files[name]
        self.send(req, 200, data, body, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": SHA})

    @staticmethod
    def send(req, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
        req.send_response(status)
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def repo_files(model_dir: Path, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    return {**files, **(extra or {})}


@pytest.fixture(scope="module")
def hub(tiny_model):  # noqa: F811
    files = repo_files(tiny_model, DECOYS)
    no_weights = {"config.json": files["config.json"], "pytorch_model.bin": DECOYS["pytorch_model.bin"]}
    fake = FakeHub({"tiny/llama": files, "tiny/gated": files, "tiny/private": files, "tiny/bin-only": no_weights},
                   gated={"tiny/gated"}, private={"tiny/private"})
    yield fake
    fake.close()


@pytest.fixture()
def hf_env(hub, tmp_path, monkeypatch):
    """Point huggingface_hub at the fake hub and an empty HF_HOME, online, without a token."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for name in ("HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # ignore a token file of this machine
    return tmp_path / "hf-home"


@pytest.fixture(scope="module")
def local_tokens(tiny_model):  # noqa: F811
    return LLM(str(tiny_model), device="cpu", l1="4MiB").generate(PROMPT, GREEDY)[0].token_ids


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def test_hub_id_loads_and_generates_like_the_local_directory(hub, hf_env, local_tokens):
    llm = LLM("tiny/llama", device="cpu", l1="4MiB")
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == local_tokens
    assert llm.tokenizer is not None and llm.tokenizer.encode("w5 w17") == [5, 17]
    snapshot = llm.engine.lm.model_dir
    assert snapshot == hf_env / "hub" / "models--tiny--llama" / "snapshots" / SHA  # HF_HOME respected
    # safetensors, config and tokenizer files only: no pickle, nothing from subfolders, no README
    fetched = hub.fetched()
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not fetched & set(DECOYS), fetched
    assert not any(p.suffix in (".bin", ".pth") for p in snapshot.rglob("*"))


def test_cached_model_loads_offline(hub, hf_env, monkeypatch, local_tokens):
    LLM("tiny/llama", device="cpu", l1="4MiB")  # fills HF_HOME
    before = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())  # and the network is gone too
    llm = LLM("tiny/llama", device="cpu", l1="4MiB")
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == local_tokens
    assert len(hub.log) == before


def test_offline_without_the_model_in_the_cache_says_so(hub, hf_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.log)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set and 'tiny/llama' is not in the local hub cache"):
        LLM("tiny/llama", device="cpu", l1="4MiB")
    assert len(hub.log) == before  # offline means no request at all


def test_no_network_says_so(hf_env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    with pytest.raises(ModelLoadError, match="cannot reach the Hugging Face Hub at .* check the network"):
        LLM("tiny/llama", device="cpu", l1="4MiB")


def test_missing_repo_says_check_the_id(hub, hf_env):
    with pytest.raises(ModelLoadError, match="neither a local directory nor a model on the Hugging Face Hub"):
        LLM("tiny/no-such-model", device="cpu", l1="4MiB")


@pytest.mark.parametrize("token", [None, "hf_token_without_access"], ids=["anonymous-401", "token-403"])
def test_gated_repo_says_accept_the_terms_and_set_hf_token(hub, hf_env, monkeypatch, token):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(ModelLoadError, match=r"'tiny/gated' is a gated model .* accept its terms .* HF_TOKEN"):
        LLM("tiny/gated", device="cpu", l1="4MiB")


def test_private_repo_needs_hf_token(hub, hf_env, monkeypatch, local_tokens):
    with pytest.raises(ModelLoadError, match="a private model needs HF_TOKEN"):
        LLM("tiny/private", device="cpu", l1="4MiB")
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # read when the model is loaded, sent as a bearer token
    assert LLM("tiny/private", device="cpu", l1="4MiB").generate(PROMPT, GREEDY)[0].token_ids == local_tokens


def test_repo_without_safetensors_is_refused_without_fetching_pickles(hub, hf_env):
    with pytest.raises(ModelLoadError, match="'tiny/bin-only' on the Hugging Face Hub has no \\*.safetensors"):
        LLM("tiny/bin-only", device="cpu", l1="4MiB")
    assert "pytorch_model.bin" not in hub.fetched()


def test_tierkv_serve_takes_a_hub_id(hub, tmp_path):
    srv = ServerProcess(["--model", "tiny/llama", "--l1", "4MiB", "--log-level", "warning"], tmp_path / "serve.log",
                        env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0",
                             "OMP_NUM_THREADS": "1"})
    try:
        srv.wait_ready()
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["tiny/llama"]
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "tiny/llama", "prompt": "w5 w17 w42", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
    assert (tmp_path / "hf-home" / "hub" / "models--tiny--llama" / "snapshots" / SHA / "model.safetensors").is_file()
