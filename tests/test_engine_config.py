"""EngineConfig: one set of engine options and defaults for LLM, Engine and tierkv-serve.

Unknown options and bad values fail before a model is loaded, with a message naming the option;
the server's flags are EngineConfig's fields with EngineConfig's defaults.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest

from tierkv import LLM, SamplingParams
from tierkv.engine.config import L2_CAP, EngineConfig, default_l2
from tierkv.host_memory import _cgroup_room, host_available_bytes
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


# Each bad value, the words its error must contain. tierkv-serve must refuse every one of them
# before it loads torch, FastAPI or a weight: in well under a second.
BAD_FLAGS = [
    (["--l1", "lots"], "--l1 must be a size"),  # the flag, not CacheConfig's field (issue 37 item 9)
    (["--l2", "-5"], "--l2 must not be negative"),
    (["--l3", "ftp://host/x"], "scheme 'ftp'"),
    (["--eviction", "fifo"], "--eviction 'fifo' is unknown"),
    (["--write-policy", "sometimes"], "--write-policy 'sometimes' is unknown"),
    (["--block-size", "0"], "block_size must be an int >= 1"),
    (["--max-num-seqs", "0"], "max_num_seqs must be an int >= 1"),
    (["--max-model-len", "1"], "max_model_len must be an int >= 2"),
    (["--dtype", "float13"], "dtype 'float13' is not supported"),
    (["--device", "tpu"], "device 'tpu' is not supported"),
    (["--model", "/nonexistent/model"], "no such directory"),
    (["--model", __file__], "is a file"),
    (["--port", "70000"], "--port must be an int from 0 to 65535"),
    (["--log-level", "loud"], "--log-level must be one of"),
    (["--max-waiting", "0"], "--max-waiting must be a positive number"),
    (["--grace-period", "-1"], "--grace-period must be a number of seconds >= 0"),
    (["--max-request-bytes", "12"], "--max-request-bytes must be at least 4KiB"),
    # an L3 stages its blocks through L2, which is off by default on CPU (issue 37 item 9): the
    # flags are named, not CacheConfig's fields
    (["--l3", "file:///tmp/x", "--device", "cpu"], "--l3 needs an L2 pool to stage blocks through: set --l2"),
    (["--l3", "file:///tmp/x", "--l2", "0"], "--l3 needs an L2 pool to stage blocks through: set --l2"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_tierkv_serve_refuses_a_bad_value_in_well_under_a_second(flags, message):
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "tierkv.server.cli", *flags], capture_output=True, text=True,
                         timeout=60)
    elapsed = time.monotonic() - t0
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert elapsed < 1.0, f"{flags} took {elapsed:.2f} s to be refused"


def test_a_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "tierkv.server.cli", "--port", str(port)], capture_output=True,
                             text=True, timeout=60)
    assert run.returncode == 2 and f"cannot listen on --host 127.0.0.1 --port {port}" in run.stderr
    assert time.monotonic() - t0 < 1.0


def test_an_l3_without_an_l2_on_a_cpu_found_by_itself_is_refused_before_the_model_loads(tmp_path):
    # no --device: the default is the GPU when there is one, so the L2 default (off on CPU) is only
    # known once torch says there is none; that must still come before a weight is read
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path)}  # an empty model cache
    run = subprocess.run([sys.executable, "-m", "tierkv.server.cli", "--l3", f"file://{tmp_path}/l3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2, run.stderr
    assert "--l3 needs an L2 pool to stage blocks through: set --l2" in run.stderr, run.stderr
    assert "(L2 is off by default on CPU)" in run.stderr and "CacheConfig" not in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "tierkv").exists(), "the bundled model was converted before the flags were checked"


def test_checking_every_option_loads_no_torch():
    # why the refusals above are fast: parsing and checking import neither torch nor FastAPI
    code = ("import sys, dataclasses; from tierkv.server.cli import load_options, ENGINE_OPTIONS, EngineConfig; "
            "opts = load_options(['--l1', '2GiB', '--l3', 'file:///tmp/x', '--dtype', 'bf16']); "
            "EngineConfig(**{n: opts[n] for n in ENGINE_OPTIONS}); "
            "heavy = sorted(m for m in ('torch', 'fastapi', 'transformers', 'uvicorn') if m in sys.modules); "
            "print(heavy)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_llm_refuses_a_bad_value_before_loading():
    # in-process, torch is loaded already: what remains must still be a fraction of a second
    for options, message in [(dict(l1="lots"), "l1"), (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device")]:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=message):
            LLM(**options)
        assert time.monotonic() - t0 < 0.5


def test_device_defaults_are_resolved_in_one_place():
    import torch

    cfg = EngineConfig().for_device(torch.device("cpu"), 4096, 1000, available=64 * GiB)
    assert (cfg.max_model_len, cfg.max_num_batched_tokens, cfg.l2) == (4096, 1024, 0)
    gpu = EngineConfig(max_model_len=100).for_device(torch.device("cuda"), 4096, 1000, available=64 * GiB)
    assert (gpu.max_model_len, gpu.max_num_batched_tokens, gpu.l2) == (100, 8192, 16 * GiB // 1000 * 1000)


GiB = 2**30


def test_default_l2_is_a_capped_share_of_host_memory_on_a_gpu_only():
    bb = 3 * 2**20 + 17  # an odd block size: the default must still be whole blocks
    assert default_l2("cuda", 64 * GiB, bb) == 16 * GiB // bb * bb  # 25%
    assert default_l2("cuda", 1024 * GiB, bb) == L2_CAP // bb * bb == 32 * GiB // bb * bb  # capped
    assert default_l2("cuda", 64 * GiB, bb) % bb == 0 and default_l2("cuda", 1024 * GiB, bb) <= L2_CAP
    assert default_l2("cuda", 10 * bb, bb) == 2 * bb  # 2.5 blocks' worth rounds down
    assert default_l2("cuda", 2 * bb, bb) == 0  # less than a block: off
    assert default_l2("cpu", 64 * GiB, bb) == 0  # CPU: host memory is the model's memory
    assert default_l2("cuda", None, bb) == 0  # unknown memory: off rather than a guess


def test_l2_zero_disables_and_an_explicit_size_is_used_as_given():
    import torch

    cuda = torch.device("cuda")
    assert EngineConfig(l2=0).for_device(cuda, 4096, 1000, available=64 * GiB).cache_config().l2 == 0
    assert EngineConfig(l2="1GiB").for_device(cuda, 4096, 1000, available=64 * GiB).cache_config().l2 == GiB
    assert EngineConfig(l2=7).for_device(cuda, 4096, 1000, available=64 * GiB).l2 == 7  # not rounded, not capped
    assert EngineConfig(l2="100GiB").for_device(cuda, 4096, 1000, available=GiB).cache_config().l2 == 100 * GiB


def test_available_host_memory_is_meminfo_within_the_cgroup_limit(tmp_path):
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    got = host_available_bytes()
    assert abs(got - min(kib * 1024, _cgroup_room() or kib * 1024)) < 2 * GiB  # others allocate meanwhile
    # a container's limit (cgroup v2 files): what is left under it, or nothing to say without one
    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text(str(3 * GiB) + "\n")
    assert _cgroup_room(str(tmp_path)) == 5 * GiB
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_room(str(tmp_path)) is None
    assert _cgroup_room(str(tmp_path / "absent")) is None


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


def test_write_policy_defaults_to_write_back_without_an_l3(tiny_llama, tmp_path):
    """Unset, the policy writes through only where another process reads (an L3); with L2 alone
    a finished request's blocks stay in L1 until L1 evicts them, and then move to L2."""
    from tierkv.server.cli import tier_summary

    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    own = LLM(tiny_llama, device="cpu", l1=8 * bb, l2=16 * bb)
    assert own.engine.config.write_policy == own.cache.config.write_policy == "write_back"
    assert "write_back" in tier_summary(own.engine)
    prompt = list(range(1, 50))  # 3 full blocks
    own.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert own.cache.stats()["tiers"]["l2"]["used_blocks"] == 0  # nothing copied while L1 had room
    own.generate([list(range(100, 100 + 16 * 7))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    again = own.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.cached_tokens == 48 and own.cache.stats()["tiers"]["l2"]["hit_tokens"] >= 48  # evicted to L2, found there
    shared = LLM(tiny_llama, device="cpu", l1=8 * bb, l2=16 * bb, l3=[f"file://{tmp_path}/l3?size=16MiB"])
    assert shared.engine.config.write_policy == "write_through"
    given = LLM(tiny_llama, device="cpu", l1=8 * bb, l2=16 * bb, write_policy="selective")
    assert given.engine.config.write_policy == "selective"
    for llm in (own, shared, given):
        llm.close()


def test_startup_lines_say_when_l2_is_the_default_share(tiny_llama, caplog, monkeypatch):
    # A CPU stands in for the GPU: only the rule is replaced (8 blocks, as if the host had room),
    # the engine, its cache and the lines it prints are real.
    from tierkv.engine import config as config_module
    from tierkv.server.cli import tier_summary

    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    with caplog.at_level("INFO", logger="tierkv.engine.engine"):
        off = LLM(tiny_llama, device="cpu", l1=8 * bb)
    assert off.cache.l2 is None and "L2 0 blocks (off: the default on CPU)" in caplog.text
    monkeypatch.setattr(config_module, "default_l2", lambda device_type, available, block_bytes: 8 * block_bytes)
    caplog.clear()
    with caplog.at_level("INFO", logger="tierkv.engine.engine"):
        llm = LLM(tiny_llama, device="cpu", l1=8 * bb)
    assert llm.cache.l2.num_blocks == 8
    assert "L2 8 blocks (the default share: 25% of available host memory, at most 32 GiB)" in caplog.text
    assert "(the default share: 25% of available host memory, at most 32 GiB)" in tier_summary(llm.engine)
    caplog.clear()
    with caplog.at_level("INFO", logger="tierkv.engine.engine"):
        given = LLM(tiny_llama, device="cpu", l1=8 * bb, l2=4 * bb)  # explicit: no default note
    assert given.cache.l2.num_blocks == 4 and "L2 4 blocks, L3" in caplog.text and "default" not in caplog.text
