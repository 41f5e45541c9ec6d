"""A paged engine of its own on tierkv: its own model code, KV buffers and attention; tierkv's cache.

The engine keeps K/V in vLLM's layout (one tensor [2, blocks, block_size, kv_heads, head_dim] per
layer) and attends through its own block tables. It registers those tensors with tierkv
(`kv_caches=`, `kv_layout="vllm"`), so tierkv moves blocks in and out of them where they are:
`admit` finds a prompt's cached prefix in L1, L2 or L3 and brings it in, the forward waits for
each layer's loads (`wait_for_layer`) and hands each layer's new full blocks to `save_layer`,
which copies them down a group of layers at a time while the forward goes on, and `commit`
shares them with later requests and processes.
Safe to call from several threads: the cache serialises its calls, and each sequence writes only
its own slots. Greedy decoding of Llama-family checkpoints (plain RoPE).

Run: python examples/custom_engine.py [--model HF_DIR] [--l3 file:///tmp/kv]   (default: bundled SmolLM2)
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import tierkv


class Llama:
    """A Llama-family decoder over weights read from a Hugging Face directory (safetensors)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        if cfg.get("rope_scaling") or cfg.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"this example runs plain-RoPE Llama, Mistral and Qwen2 checkpoints; {model_dir} is "
                             f"{cfg.get('model_type')} with rope_scaling {cfg.get('rope_scaling')}")
        self.num_layers, self.heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps, self.theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
        self.dtype, self.device = dtype, torch.device(device)
        weights = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(f))
        self.w = {k.removeprefix("model."): v.to(device, dtype) for k, v in weights.items()}
        self.w.setdefault("lm_head.weight", self.w["embed_tokens.weight"])  # tied embeddings

    def layout(self, block_size: int = 16) -> tierkv.KVLayout:
        return tierkv.KVLayout(self.num_layers, self.kv_heads, self.head_dim, self.dtype, block_size)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(self.dtype) * self.w[f"{name}.weight"]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by its token's position (the rotate-half convention)."""
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim)
        angles = positions[:, None].float() * inv[None]  # [T, D/2]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """ids, positions [T] -> hidden states [T, hidden]. `attend(layer, q, k, v)` -> [T, heads, D]
        writes this step's k, v [T, kv_heads, D] into the paged buffers and attends over them."""
        x = self.w["embed_tokens.weight"][ids]  # [T, hidden]
        for i in range(self.num_layers):
            p = f"layers.{i}"
            h = self._norm(x, f"{p}.input_layernorm")
            q = self._linear(h, f"{p}.self_attn.q_proj").view(-1, self.heads, self.head_dim)
            k = self._linear(h, f"{p}.self_attn.k_proj").view(-1, self.kv_heads, self.head_dim)
            v = self._linear(h, f"{p}.self_attn.v_proj").view(-1, self.kv_heads, self.head_dim)
            o = attend(i, self._rope(q, positions), self._rope(k, positions), v)
            x = x + self._linear(o.reshape(len(ids), -1), f"{p}.self_attn.o_proj")
            h = self._norm(x, f"{p}.post_attention_layernorm")
            gate_up = F.silu(self._linear(h, f"{p}.mlp.gate_proj")) * self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(gate_up, f"{p}.mlp.down_proj")
        return self._norm(x, "norm")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.w["lm_head.weight"]).float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, heads, D] at positions start.. over k, v [start + n, kv_heads, D], causal -> [n, heads, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total, device=q.device)[None] <= torch.arange(start, start + n, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


class PagedEngine:
    """Greedy batched generation over the engine's own paged buffers, with tierkv as the cache."""

    def __init__(self, model: Llama, num_blocks: int, config: tierkv.CacheConfig, name: str, block_size: int = 16):
        self.model, self.bs = model, block_size
        # the engine's KV, in vLLM's layout: per layer [2 (K, V), blocks, block_size, kv_heads, head_dim]
        self.kv = [torch.zeros(2, num_blocks, block_size, model.kv_heads, model.head_dim, dtype=model.dtype,
                               device=model.device) for _ in range(model.num_layers)]
        self.cache = tierkv.TieredKVCache(model.layout(block_size), config, kv_caches=self.kv, kv_layout="vllm",
                                          model=name)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, eos: set[int] = frozenset()) -> list[dict]:
        """Each prompt's new tokens, how many of its tokens the cache served, and from which tier."""
        # cached prefix found (L1/L2/L3) and on its way in; room reserved for the whole prompt
        seqs = [self.cache.admit(p) for p in prompts]
        tokens = [list(p) for p in prompts]
        out = [{"tokens": [], "cached": s.num_cached_tokens, "by_tier": s.cached_by_tier} for s in seqs]
        done = [s.num_cached_tokens for s in seqs]  # tokens whose KV is in the buffers
        live = list(range(len(prompts)))
        try:
            while live:
                step = [(i, tokens[i][done[i] :]) for i in live]  # uncomputed prompt, then one token each
                for i, new in step:
                    if done[i] + len(new) > seqs[i].num_tokens:  # past the prompt: room for the sampled token
                        self.cache.append(seqs[i], done[i] + len(new) - seqs[i].num_tokens)
                last = self._forward([seqs[i] for i, _ in step], [done[i] for i, _ in step], [n for _, n in step])
                for (i, new), token in zip(step, last.argmax(-1).tolist()):
                    done[i] += len(new)
                    # the tokens whose KV is written (not `token`, whose KV the next step writes):
                    # full blocks are shared from now on
                    self.cache.commit(seqs[i], tokens[i][: done[i]])
                    tokens[i].append(token)
                    out[i]["tokens"].append(token)
                live = [i for i in live if len(out[i]["tokens"]) < max_new and out[i]["tokens"][-1] not in eos]
        finally:
            for s in seqs:
                self.cache.free(s)  # shared blocks stay cached; private ones go back
        return out

    def _forward(self, seqs, starts: list[int], new: list[list[int]]) -> torch.Tensor:
        """One step over a flat batch: sequence b computes new[b] from position starts[b].
        Returns the logits of each sequence's last position [B, vocab]."""
        dev = self.model.device
        ids = torch.tensor([t for n in new for t in n], device=dev)  # [T]
        positions = torch.tensor([s + j for s, n in zip(starts, new) for j in range(len(n))], device=dev)  # [T]
        tables = self.cache.block_table(seqs)  # [B, max_blocks]: each sequence's blocks in the buffers
        block_of = torch.tensor([s.slots[(start + j) // self.bs] for s, start, n in zip(seqs, starts, new)
                                 for j in range(len(n))], device=dev)  # [T] buffer block of each new token

        def attend(layer: int, q, k, v):
            self.cache.wait_for_layer(layer, seqs)  # this layer of the cached prefix has landed
            buf = self.kv[layer]  # [2, blocks, bs, kv_heads, D]
            buf[0, block_of, positions % self.bs] = k
            buf[1, block_of, positions % self.bs] = v
            self.cache.save_layer(layer, seqs)  # full blocks of this step go down to L2 now
            outs, at = [], 0
            for b, (start, n) in enumerate(zip(starts, map(len, new))):
                end = start + n
                blocks = tables[b, : -(-end // self.bs)]
                keys = buf[0, blocks].flatten(0, 1)[:end]  # [end, kv_heads, D]
                vals = buf[1, blocks].flatten(0, 1)[:end]
                outs.append(attention(q[at : at + n], keys, vals, start))
                at += n
            return torch.cat(outs)

        hidden = self.model.forward(ids, positions, attend)
        last = torch.tensor(list(map(len, new)), device=dev).cumsum(0) - 1
        return self.model.logits(hidden[last])


@torch.inference_mode()
def reference_generate(model: Llama, prompt: list[int], max_new: int, eos: set[int] = frozenset()) -> list[int]:
    """The same greedy decoding with no cache and no paging: every step recomputes the whole sequence."""
    tokens, out = list(prompt), []
    while len(out) < max_new and (not out or out[-1] not in eos):
        ids = torch.tensor(tokens, device=model.device)
        hidden = model.forward(ids, torch.arange(len(tokens), device=model.device),
                               lambda layer, q, k, v: attention(q, k, v, 0))
        out.append(int(model.logits(hidden[-1:]).argmax(-1)))
        tokens.append(out[-1])
    return out


def chat(tok, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ready for the assistant's answer."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF model dir (default: the bundled SmolLM2-135M)")
    parser.add_argument("--l3", default=None, help="an L3 URL shared with later runs, e.g. file:///tmp/tierkv-example")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tierkv.engine.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Llama(model_dir, device, torch.bfloat16 if device == "cuda" else torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = tierkv.CacheConfig(l2="256MiB", l3=[args.l3] if args.l3 else [])
    engine = PagedEngine(model, num_blocks=512, config=config, name=model_dir.name)
    print(f"model {model_dir.name} on {device}; {model.num_layers} layers of paged KV in vLLM's layout, "
          f"{engine.cache.l1.num_blocks} blocks registered with tierkv")

    system = ("You are the help desk of a city library. Opening hours: 9 to 18 on weekdays, 10 to 14 on "
              "Saturdays, closed on Sundays. Late returns cost 20 cents a day. Answer in one sentence.")
    questions = ["When are you open on Saturday?", "How much is a late return?"]
    eos = {tok.eos_token_id}
    for q in questions:  # one after the other: the second finds the system prompt's blocks
        prompt = chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        start = time.perf_counter()
        res = engine.generate([prompt], args.max_new_tokens, eos)[0]
        print(f"Q: {q}\nA: {tok.decode(res['tokens'], skip_special_tokens=True).strip()}")
        print(f"prompt {len(prompt)} tokens, cached tokens {res['cached']} {res['by_tier']}, computed "
              f"{len(prompt) - res['cached']}, {len(res['tokens'])} new in {time.perf_counter() - start:.2f}s")
    # two threads share the engine and its cache: each request holds its own blocks
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(
        [chat(tok, [{"role": "user", "content": f"Say the number {i}."}])],
        4, eos)[0])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"two threads: {[len(results[i]['tokens']) for i in range(2)]} tokens")
    assert not engine.cache.live_sequences(), "a sequence was not freed"  # a leak check
    s = engine.cache.stats()
    print(f"cache: {s['hit_tokens']} hit tokens of {s['query_tokens']} looked up, {s['blocks']} blocks indexed")
    engine.cache.close()


if __name__ == "__main__":
    main()
