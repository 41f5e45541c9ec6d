"""EngineConfig: one set of engine options and defaults for LLM, Engine and tierkv-serve.

Unknown options and bad values fail before a model is loaded, with a message naming the option;
the server's flags are EngineConfig's fields with EngineConfig's defaults.
"""

from __future__ import annotations

import dataclasses

import pytest

from tierkv import LLM
from tierkv.engine.config import EngineConfig
from tierkv.engine.engine import Engine
from tierkv.errors import ConfigError
from tierkv.server.cli import load_options


def test_unknown_and_bad_options_fail_before_loading():
    with pytest.raises(ConfigError, match="unknown engine option 'max_num_seq'.*max_num_seqs"):
        LLM("/nonexistent/model", max_num_seq=4)  # the model path is never looked at
    with pytest.raises(ConfigError, match="block_size must be an int >= 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="async_scheduling must be true or false"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be an int >= 2"):
        EngineConfig(max_num_batched_tokens=1)
    with pytest.raises(ConfigError, match="eviction"):
        EngineConfig(eviction="fifo")  # the cache's own checks run here too
    with pytest.raises(ConfigError, match="either config= or a model"):
        Engine("/nonexistent/model", config=EngineConfig())


def test_device_defaults_are_resolved_in_one_place():
    import torch

    cfg = EngineConfig().for_device(torch.device("cpu"), 4096)
    assert (cfg.max_model_len, cfg.max_num_batched_tokens) == (4096, 1024)
    gpu = EngineConfig(max_model_len=100).for_device(torch.device("cuda"), 4096)
    assert (gpu.max_model_len, gpu.max_num_batched_tokens) == (100, 8192)


def test_server_flags_are_the_engine_options():
    opts = load_options([])
    for f in dataclasses.fields(EngineConfig):
        if f.name != "cache_dir":
            assert opts[f.name] == f.default, f.name
    assert load_options(["--no-async-scheduling"])["async_scheduling"] is False
    assert EngineConfig(**{f.name: opts[f.name] for f in dataclasses.fields(EngineConfig) if f.name in opts}) == EngineConfig()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from models import save_tiny_checkpoint

    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-context"), seed=2))


def test_a_context_the_tiers_cannot_hold_is_lowered_or_refused(tiny_llama, caplog):
    from tierkv import SamplingParams

    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    with caplog.at_level("WARNING", logger="tierkv.engine.engine"):
        small = LLM(tiny_llama, device="cpu", l1=4 * bb)  # 4 blocks of 16 tokens, no L2
    assert small.engine.max_model_len == 64
    assert "max_model_len lowered from the model's 512 to 64" in caplog.text
    # the longest prompt the lowered length allows is served, to its last position
    out = small.generate([list(range(63))], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    with pytest.raises(ConfigError, match="at most 63.*raise l1 or l2"):
        small.generate([list(range(64))], use_tqdm=False)
    # streamed: half of L1 plus L2
    assert LLM(tiny_llama, device="cpu", l1=4 * bb, l2=10 * bb).engine.max_model_len == (2 + 10) * 16
    with pytest.raises(ConfigError, match="max_model_len 100 needs 7 KV blocks.*L1 holds 4 and L2 0.*64 or less"):
        LLM(tiny_llama, device="cpu", l1=4 * bb, max_model_len=100)
    assert LLM(tiny_llama, device="cpu", l1=4 * bb, max_model_len=64).engine.max_model_len == 64
