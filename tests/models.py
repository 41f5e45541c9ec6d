"""Test helpers: tiny random-weight HF checkpoints, and a minimal greedy loop over a paged pool.

The checkpoints are built with transformers and saved as safetensors, so the engine's loader and
transformers read the very same weights. The greedy loop gives each sequence contiguous pool
blocks (no cache library involved) and supports chunked prefill mixed with decodes.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tierkv.engine.attention import AttentionMetadata
from tierkv.engine.model import CausalLM

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

# mscale differs from mscale_all_dim so that YaRN scales cos/sin as well as the softmax
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                 "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# gpt-oss's YaRN (truncate false) over a short original context, so the ramp covers a few dims
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


# the sliding window of the `hybrid` fixture's layers (tests/conftest.py)
HYBRID_WINDOW = 16


def tiny_config(kind: str):
    """A transformers config for one tiny variant of the families the engine supports."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        return LlamaConfig(**TINY)
    if kind == "llama3":  # Llama 3.1 RoPE scaling, with bias on attention and MLP for coverage
        return LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE),
                           attention_bias=True, mlp_bias=True)
    if kind == "qwen2":  # Qwen2.5-0.5B style: q/k/v bias, tied embeddings
        return Qwen2Config(**TINY, tie_word_embeddings=True)
    if kind == "qwen3":  # q/k norm, explicit head_dim that differs from hidden / heads
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    if kind == "mistral":  # a sliding window much shorter than the test prompts
        return MistralConfig(**TINY, sliding_window=8)
    if kind == "gemma3":  # 6 layers: five sliding (window 8) to one global with linear RoPE scaling
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**dict(TINY, num_hidden_layers=6), head_dim=32, query_pre_attn_scalar=24,
                                sliding_window=8, rope_scaling={"rope_type": "linear", "factor": 8.0})
    if kind == "qwen3_moe":  # 3 layers, the first dense (mlp_only_layers): 8 experts, top-2, renormalised
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**dict(TINY, num_hidden_layers=3), head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])
    if kind == "deepseek_v3":  # DeepSeek-V2-Lite's structure scaled down: MLA without q LoRA, YaRN, 3 layers
        from transformers import DeepseekV3Config  # (the first dense), 8 routed experts in 2 groups + 1 shared

        return DeepseekV3Config(**dict(TINY, num_hidden_layers=3, num_key_value_heads=4), q_lora_rank=None,
                                kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
                                rope_parameters=dict(DEEPSEEK_YARN))
    if kind == "gpt_oss":  # 4 layers alternating sliding (window 8) / full, sinks, 4 experts top-2, YaRN
        from transformers import GptOssConfig

        return GptOssConfig(**dict(TINY, num_hidden_layers=4), head_dim=32, sliding_window=8, num_local_experts=4,
                            num_experts_per_tok=2, rope_parameters=dict(GPT_OSS_YARN))
    raise ValueError(kind)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Large random weights so that logits are peaked: greedy choices are far from ties, and a
    wrong implementation cannot hide behind near-uniform outputs. Norm weights stay near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def save_word_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer in model directory `path`: token i <-> the word "w{i}", so that a
    served text names its token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def save_tiny_checkpoint(kind: str, path: Path, seed: int = 0, std: float = 0.3, **overrides) -> Path:
    """Build a tiny random-weight model of `kind` and save it as a HF directory at `path`;
    `overrides` replace config fields (e.g. vocab_size=509); `std`: the weights' (randomize_)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed, std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_pool(model: CausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    """[layers, num_blocks, 2, block_size, Hkv, D] zeroed pool in the model's dtype and device;
    Hkv is the model's local KV heads (all of them unless it is a tensor-parallel shard)."""
    cfg = model.config
    w = model.model.embed_tokens.weight
    return torch.zeros(cfg.num_layers, num_blocks, 2, block_size, model.num_local_kv_heads, cfg.head_dim,
                       dtype=w.dtype, device=w.device)


@torch.inference_mode()
def paged_greedy(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk: int | None = None,
    block_size: int = 16,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-decode all prompts together; returns (new token ids, prompt-end logits) per prompt.

    Every step each unfinished sequence contributes its next prompt chunk (all of it when
    `chunk` is None) or, once its prompt is done, its last sampled token; the step is a pure
    decode batch exactly when every sequence contributes one token.
    """
    device = model.model.embed_tokens.weight.device
    blocks = [math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts]
    first = [sum(blocks[:i]) for i in range(len(prompts))]  # each sequence's first block
    max_blocks = max(blocks)
    pool = make_pool(model, sum(blocks), block_size)
    table = torch.zeros(len(prompts), max_blocks, dtype=torch.int32)
    for b, (start, n) in enumerate(zip(first, blocks)):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)

    done = [0] * len(prompts)  # tokens already in the pool per sequence
    outputs: list[list[int]] = [[] for _ in prompts]
    prompt_logits: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    while any(len(o) < max_new_tokens for o in outputs):
        active = [b for b in range(len(prompts)) if len(outputs[b]) < max_new_tokens]
        ids, pos, q_lens, wants_logits = [], [], [], []
        for b in active:
            seq = prompts[b] + outputs[b]
            n = 1 if done[b] >= len(prompts[b]) else min(chunk or len(prompts[b]), len(prompts[b]) - done[b])
            ids += seq[done[b] : done[b] + n]
            pos += range(done[b], done[b] + n)
            q_lens.append(n)
            wants_logits.append(done[b] + n >= len(prompts[b]))
        cu = torch.tensor([0] + q_lens).cumsum(0)
        seq_lens = torch.tensor([done[b] + n for b, n in zip(active, q_lens)], dtype=torch.int32)
        slots = torch.cat([first[b] * block_size + torch.arange(done[b], done[b] + n)
                           for b, n in zip(active, q_lens)])
        logit_rows = [int(cu[i + 1]) - 1 for i, w in enumerate(wants_logits) if w]
        meta = AttentionMetadata(
            slot_mapping=slots.to(device),
            block_tables=table[active].to(device),
            seq_lens=seq_lens.to(device),
            cu_seqlens_q=cu.to(torch.int32).to(device),
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            is_decode=all(n == 1 for n in q_lens),
        )
        logits = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), pool, meta)
        row = 0
        for b, n, w in zip(active, q_lens, wants_logits):
            first_token = done[b] < len(prompts[b])
            done[b] += n
            if w:
                if first_token:
                    prompt_logits[b] = logits[row].cpu()
                outputs[b].append(int(logits[row].argmax()))
                row += 1
    return outputs, prompt_logits


@torch.inference_mode()
def every_position_logits(model: CausalLM, prompt: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits [T, vocab] of every position of `prompt`, prefilled in one step into pool blocks
    that are deliberately out of order."""
    t = len(prompt)
    blocks = math.ceil(t / block_size)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)[None]  # [1, blocks]
    pos = torch.arange(t)
    device = model.model.embed_tokens.weight.device
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(slot_mapping=slots.to(device), block_tables=table.to(device),
                             seq_lens=torch.tensor([t], dtype=torch.int32, device=device),
                             cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=device),
                             logits_indices=torch.arange(t, device=device), is_decode=False)
    return model(torch.tensor(prompt, device=device), pos.to(device), make_pool(model, blocks, block_size), meta)


def truncate_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    """Tokens up to and including the first eos (transformers stops generating there)."""
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    return tokens


_BUNDLED_CACHE: list[Path] = []


def bundled_cache_dir() -> Path:
    """One temporary cache dir per test process holding the converted bundled SmolLM2, so the
    GGUF is converted once per run however many tests use it (removed at exit)."""
    if not _BUNDLED_CACHE:
        import atexit
        import shutil
        import tempfile

        from tierkv.engine.loader import bundled_model_dir

        root = Path(tempfile.mkdtemp(prefix="tierkv-test-cache-"))
        atexit.register(shutil.rmtree, root, True)
        bundled_model_dir(root)
        _BUNDLED_CACHE.append(root)
    return _BUNDLED_CACHE[0]
