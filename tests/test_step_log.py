"""The engine's step log (TIERKV_STEP_LOG): a JSON line per added request and per step that ran or
admitted something, with its phases in order, the requests admitted and each request run with its
new tokens, so that a round can be read offline. Off, the engine writes nothing."""

from __future__ import annotations

import json

import pytest
from models import save_tiny_checkpoint

from tierkv import LLM, SamplingParams
from tierkv.engine.step_log import ENV, StepLog
from tierkv.errors import ConfigError


def test_every_request_and_step_is_logged_in_order(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(path))
    llm = LLM(str(save_tiny_checkpoint("llama", tmp_path / "llama", seed=3)), device="cpu", max_num_batched_tokens=64)
    prompts = [list(range(10, 110)), list(range(200, 230))]  # 100 tokens: two chunks of a 64-token budget
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]

    adds = [x for x in lines if x["ev"] == "add"]
    assert [a["n"] for a in adds] == [100, 30]
    ids = [a["id"] for a in adds]
    steps = [x for x in lines if x["ev"] == "step"]
    for s in steps:  # the phases in order
        assert s["t0"] <= s["t1"] <= s["t2"] <= s["t3"] <= s["t4"]
    assert sorted(x for s in steps for x in s["admitted"]) == sorted(ids)  # each admitted once
    for rid, n in zip(ids, (100, 30)):  # its prompt in chunks, then one token a step for 3 more tokens
        new = [k for s in steps for r, k in s["run"] if r == rid]
        assert sum(new) == n + 3 and new[-3:] == [1, 1, 1]
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_a_file_that_cannot_be_written_is_refused_saying_so(tmp_path):
    with pytest.raises(ConfigError, match="TIERKV_STEP_LOG names .* cannot be opened"):
        StepLog(str(tmp_path / "no-such-dir" / "steps.jsonl"))


def test_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(save_tiny_checkpoint("llama", tmp_path / "llama", seed=3)), device="cpu")
    assert llm.engine.step_log is None
