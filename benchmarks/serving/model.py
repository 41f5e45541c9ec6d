"""The model the servers load: made on the spot (random weights), a given directory or the bundled
SmolLM2, and what the benchmark needs of its shape (vocabulary, KV bytes a token). It never starts
a server; an external server's model is only described by the bundled model's shape.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class ModelInfo:
    source: str  # "made: llama-3.1-8b", "dir", "bundled", "external"
    path: Path | None  # the directory servers load (None: the bundled default)
    vocab_size: int
    max_position_embeddings: int
    shape: dict  # layers, kv heads, head dim
    kv_bytes_per_token: int  # 2 (K and V) x layers x kv_heads x head_dim x dtype bytes


def kv_dtype_bytes() -> int:
    """The KV pool takes the model's dtype; tierkv-serve's 'auto' is bf16 on a GPU, fp32 on a CPU."""
    import torch

    return 2 if torch.cuda.is_available() else 4


def describe(config: dict, source: str, path: Path | None) -> ModelInfo:
    layers, kv_heads = config["num_hidden_layers"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelInfo(source, path, config["vocab_size"], config.get("max_position_embeddings", 0),
                     dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim),
                     2 * layers * kv_heads * head_dim * kv_dtype_bytes())


def make_model(name: str, tmp: Path) -> tuple[ModelInfo, float]:
    """A random-weight Llama saved as a HF safetensors directory under `tmp` (outside the repo): the
    8B shape built in bf16 on the GPU when there is one, or the tiny one; bench_latency's shapes."""
    import torch
    from bench_latency import llama_setup
    from bench_throughput import release_memory, save_random_model

    if name != "tiny" and not torch.cuda.is_available():
        raise SystemExit(f"--make-model {name} builds and serves 16 GB of bf16 weights: it needs a GPU; "
                         "use --make-model tiny on a CPU")
    config, device, dtype = llama_setup(smoke=(name == "tiny"))
    t = time.perf_counter()
    path = tmp / name
    model, _ = save_random_model(config, path, device, dtype)
    del model
    release_memory()
    return describe(config.to_dict(), f"made: {name}", path), time.perf_counter() - t


def model_info(a, tmp: Path) -> tuple[ModelInfo, float | None]:
    if a.make_model:
        return make_model(a.make_model, tmp)
    if a.server_model:
        path = Path(a.server_model)
        return describe(json.loads((path / "config.json").read_text()), "dir", path), None
    # the bundled SmolLM2: its converted directory in the user's cache (what tierkv-serve loads)
    from tierkv.engine.loader import bundled_model_dir

    config = json.loads((bundled_model_dir() / "config.json").read_text())
    return describe(config, "bundled" if not a.url else "external (shape of the bundled model)", None), None


def given_or_made(path: Path | None, smoke: bool, tmp: Path) -> tuple[ModelInfo, float | None]:
    """The model at `path`, or a random-weight Llama made under `tmp` (the 8B shape, tiny with
    `smoke`), and the seconds making it took (None for a given one)."""
    if path is not None:
        return describe(json.loads((path / "config.json").read_text()), "dir", path), None
    import torch

    threads = torch.get_num_threads()
    made = make_model("tiny" if smoke else "llama-3.1-8b", tmp)
    torch.set_num_threads(threads)  # as many as the server's: making a tiny model sets 1
    return made


def take_positions(model: ModelInfo, positions: int) -> None:
    """Let a made model take `positions` tokens: random weights with RoPE take any position, so its
    config may say so (the server refuses a --max-model-len beyond it)."""
    if positions <= model.max_position_embeddings:
        return
    config = json.loads((model.path / "config.json").read_text())
    config["max_position_embeddings"] = model.max_position_embeddings = positions
    (model.path / "config.json").write_text(json.dumps(config))
