"""tierkv.kernels: the GPU kernels (paged attention, KV writes, block copies, fp8 KV
(de)quantisation, the decoder's fused RMSNorm / RoPE / SiLU-mul, the mixture-of-experts layer and
its router's top-k, the sampler's top-k/top-p filter, the linear layers' one-row GEMV), dispatched by device.

Triton kernels run on CUDA tensors and the torch reference everywhere else. The environment
variable TIERKV_KERNELS=reference|triton forces one implementation (triton on CPU means the
Triton interpreter, which also needs TRITON_INTERPRET=1 set before the first import). The Triton
modules are imported lazily, so CPU-only installs without triton work. Kernels know nothing of tiers:
this package imports nothing from tierkv, so `import tierkv.kernels` loads it alone.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

from .errors import ShapeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ShapeError",
    "backend_for",
    "kv_write",
    "paged_decode",
    "decode_launch",
    "paged_prefill",
    "gather_blocks",
    "scatter_blocks",
    "copy_blocks",
    "PlaneTable",
    "copy_planes",
    "UploadTable",
    "upload",
    "quantize_fp8",
    "dequantize_fp8",
    "gather_quantize_fp8",
    "dequantize_scatter_fp8",
    "compile_variants",
    "rms_norm",
    "rope_kv_write",
    "silu_mul",
    "gelu_tanh_mul",
    "top_k_top_p_filter",
    "mla_decode",
    "fused_moe",
    "moe_topk",
    "linear",
]

# public name -> module of this package that holds its Triton version; a name missing here
# has no Triton version yet and is served by the reference on every device.
_TRITON_HOME: dict[str, str] = {
    "kv_write": "write",
    "paged_decode": "decode",
    "paged_prefill": "prefill",
    "gather_blocks": "block_copy",
    "scatter_blocks": "block_copy",
    "copy_blocks": "block_copy",
    "copy_planes": "plane_copy",
    "upload": "array_upload",
    "quantize_fp8": "fp8",
    "dequantize_fp8": "fp8",
    "gather_quantize_fp8": "fp8",
    "dequantize_scatter_fp8": "fp8",
    "rms_norm": "norm",
    "rope_kv_write": "rope",
    "silu_mul": "activation",
    "gelu_tanh_mul": "activation",
    "top_k_top_p_filter": "sampling",
    "mla_decode": "mla",
    "fused_moe": "moe",
    "moe_topk": "router",
    "linear": "matvec",
}


def backend_for(tensor: torch.Tensor) -> str:
    """Which implementation serves `tensor`: "triton" or "reference"."""
    forced = os.environ.get("TIERKV_KERNELS", "").strip().lower()
    if forced in ("reference", "triton"):
        return forced
    return "triton" if tensor.is_cuda else "reference"


def __getattr__(name: str):
    # torch loads with the first kernel call (or `kernels.reference`), not with the package, so
    # that tierkv.errors, which builds on ShapeError, and config validation stay light to import.
    if name == "reference":
        return _reference()
    if name == "PlaneTable":
        return importlib.import_module(".planes", __name__).PlaneTable
    if name == "UploadTable":
        return importlib.import_module(".upload_table", __name__).UploadTable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reference() -> ModuleType:
    return importlib.import_module(".reference", __name__)


def _impl(name: str, tensor: torch.Tensor):
    return getattr(_home(name, backend_for(tensor)), name)  # looked up per call: a test may patch it


@functools.cache
def _home(name: str, backend: str) -> ModuleType:
    # once per kernel and backend: an eager step makes ~200 kernel calls, and import_module's
    # lookup of an already loaded module cost ~1.5 us each
    if backend == "reference" or name not in _TRITON_HOME:
        return _reference()
    return importlib.import_module(f".{_TRITON_HOME[name]}", __name__)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into kv [num_blocks, 2, bs, Hkv, D] at slot_mapping [T] (-1 = skip)."""
    return _impl("kv_write", kv)(k, v, kv, slot_mapping)


def paged_decode(q, kv, block_tables, seq_lens, scale: float, sliding_window: int | None = None, sinks=None):
    """q [B, Hq, D] over the paged kv through block_tables [B, max_blocks]; see reference.paged_decode.
    sinks: None, or [Hq] attention-sink logits (gpt-oss; any float dtype, read in fp32), one more
    softmax column per head."""
    return _impl("paged_decode", q)(q, kv, block_tables, seq_lens, scale, sliding_window, sinks)


def decode_launch(kv: torch.Tensor, batch: int, max_tokens: int) -> tuple[int, int] | None:
    """(splits per sequence, tokens per tile) paged_decode launches with for `batch` sequences
    over the layer pool kv [num_blocks, 2, bs, Hkv, D] through block tables max_tokens wide; None
    where the reference serves kv (it has no launch). Callers that fix the table's width ahead of
    time (CUDA graphs) ask it which widths launch alike."""
    if backend_for(kv) == "reference":
        return None
    decode = importlib.import_module(".decode", __name__)
    return decode.decode_launch(batch, kv.shape[3], max_tokens, kv.shape[4], kv.device)


def paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale: float, sliding_window: int | None = None,
                  context: int | None = None, sinks=None, plans: dict | None = None):
    """Flat varlen q [T, Hq, D], causal over the paged kv; see reference.paged_prefill.

    context: when the batch is one sequence, its cached token count as the host knows it; a long
    chunk may then take a faster path on the GPU (kernels/dense.py). The result is the same.
    sinks: None, or [Hq] attention-sink logits (gpt-oss; any float dtype, read in fp32), one more
    softmax column per head.
    plans: a dict kept for one batch, so that its layers share one launch plan (prefill.py).
    """
    if backend_for(q) == "reference":
        return _reference().paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, sinks)
    return _impl("paged_prefill", q)(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, context,
                                     sinks, plans)


def mla_decode(q_latent, q_pe, kv, block_tables, seq_lens, scale: float):
    """Absorbed multi-head latent attention of one query per sequence: q_latent [B, H, L] and q_pe
    [B, H, R] over the latent pool kv [num_blocks, 2, bs, 1, (L + R) / 2] (each token's latent split
    over the K and V planes); returns the latent-space output [B, H, L]. See reference.mla_decode."""
    return _impl("mla_decode", q_latent)(q_latent, q_pe, kv, block_tables, seq_lens, scale)


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[layers, slots, 2, bs, h, d] pool -> [n, layers, 2, bs, h, d] out (see reference.gather_blocks)."""
    return _impl("gather_blocks", pool)(pool, slots, out)


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, layers, 2, bs, h, d] src -> pool slots (see reference.scatter_blocks)."""
    return _impl("scatter_blocks", pool)(src, pool, slots)


def copy_blocks(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> torch.Tensor:
    """dst[dst_slots[i]] = src[src_slots[i]] along dim 0; src may be pinned host (see reference.copy_blocks)."""
    return _impl("copy_blocks", dst)(src, src_slots, dst, dst_slots)


def copy_planes(src, src_slots: torch.Tensor, dst, dst_slots: torch.Tensor, planes: tuple[int, int] | None = None):
    """For p in planes [first, end) (default all): dst.planes[p][dst_slots[i]] = src.planes[p][src_slots[i]].

    src, dst: PlaneTables (any paged KV layout, GPU or pinned host; see kernels/planes.py). Runs
    the Triton kernel where either table is addressed from CUDA, the reference otherwise.
    """
    ptrs = [getattr(table, "ptrs", None) for table in (src, dst)]
    at = next((p for p in ptrs if getattr(p, "is_cuda", False)), ptrs[0] if ptrs[0] is not None else ptrs[1])
    if at is None:  # neither is a PlaneTable: the reference's checks say so
        return _reference().copy_planes(src, src_slots, dst, dst_slots, planes)
    return _impl("copy_planes", at)(src, src_slots, dst, dst_slots, planes)


def upload(table, counts) -> None:
    """Copy the first counts[i] elements of each host array of `table` (an UploadTable) into its
    device buffer, ordered on the current stream. On a GPU, one kernel reads the pinned arrays
    through unified addressing, so a step's inputs never queue behind DMAs on the copy engines;
    elsewhere, torch's copies (see reference.upload)."""
    return _impl("upload", table.targets[0])(table, counts)


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """x [..., T, H, D] -> q (fp8, same shape) and scales [..., H] fp32, one per head over T x D
    (see reference.quantize_fp8; one Triton kernel for blocks [n, layers, 2, bs, h, d] on CUDA)."""
    return _impl("quantize_fp8", x)(x, q, scales)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """q [..., T, H, D] fp8 with scales [..., H] -> out in its own dtype (see reference.dequantize_fp8)."""
    return _impl("dequantize_fp8", out)(q, scales, out)


def gather_quantize_fp8(pool: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """pool [layers, N, 2, bs, h, d] blocks `slots` [n] -> q [n, layers, 2, bs, h, d] fp8 and scales
    [n, layers, 2, h]: gather_blocks + quantize_fp8 fused (one kernel on CUDA, same bytes)."""
    return _impl("gather_quantize_fp8", pool)(pool, slots, q, scales)


def dequantize_scatter_fp8(q: torch.Tensor, scales: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """The inverse of gather_quantize_fp8: q, scales -> pool blocks `slots` in the pool's dtype."""
    return _impl("dequantize_scatter_fp8", pool)(q, scales, pool, slots)


def compile_variants(kv: torch.Tensor, num_heads: int, scale: float, windows=(None,), sinks: bool = False) -> int:
    """Compile every attention kernel variant a run may choose on this layer pool `kv`, now rather
    than at the first request that needs it (Triton only; a no-op returning 0 for the reference).
    sinks: the model's layers have attention sinks (gpt-oss): compile those variants instead."""
    if backend_for(kv) == "reference":
        return 0
    return importlib.import_module(".prefill", __name__).compile_variants(kv, num_heads, scale, windows, sinks)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, unit_offset: bool = False
):
    """RMSNorm of x [..., H] (rows may be strided) by weight [H], in HF's rounding order.

    Returns out [..., H]; with residual [..., H] returns (rms_norm(x + residual), x + residual),
    the sum rounded to x's dtype: the "add residual, then norm" of a decoder layer. unit_offset:
    Gemma's norm, which scales by (1 + weight) in fp32 before rounding (Llama rounds first).
    """
    return _impl("rms_norm", x)(x, weight, eps, residual, unit_offset)


def rope_kv_write(
    q, k, v, cos, sin, kv: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
    unit_offset: bool = False,
) -> torch.Tensor:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D] with cos, sin [T, D]; rotated k and v [T, Hkv, D] go
    into kv [num_blocks, 2, bs, Hkv, D] at slot_mapping [T] (-1 = skip). Returns rotated q [T, Hq, D].
    q_norm, k_norm [D] (both or neither): RMSNorm each q / k head first, as rms_norm(.., eps,
    unit_offset=unit_offset) would (Qwen3, Gemma 3), in the same launch."""
    return _impl("rope_kv_write", kv)(q, k, v, cos, sin, kv, slot_mapping, q_norm, k_norm, eps, unit_offset)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: gate_up [T, 2 * I] (gate, then up) -> F.silu(gate) * up [T, I]."""
    return _impl("silu_mul", gate_up)(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate, then up) -> gelu_tanh(gate) * up [T, I]: Gemma's GeGLU."""
    return _impl("gelu_tanh_mul", gate_up)(gate_up)


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] -> a copy with each row's tokens outside its top_k [B] / top_p [B] set to -inf
    (either may be None); ties at the boundary are all kept. See reference.top_k_top_p_filter."""
    return _impl("top_k_top_p_filter", logits)(logits, top_k, top_p)


def fused_moe(x, w13, w2, topk_ids, topk_weights, activation: str = "silu", b13=None, b2=None,
              alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The routed experts of a sparse MoE block, x [T, H] -> [T, H]: each token's k experts
    (topk_ids [T, k]) weighted by topk_weights [T, k] and summed.

    Expert weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
    optional biases b13 [E, 2I] and b2 [E, H]. activation: "silu" (silu(gate) * up) or
    "swigluoai" (gpt-oss's clamped SwiGLU with alpha and limit). See reference.fused_moe; the
    Triton version (kernels/moe.py) sorts tokens by expert and runs grouped GEMMs (for a few tokens:
    no sort, two launches per pair and per token), with no host sync.
    """
    return _impl("fused_moe", x)(x, w13, w2, topk_ids, topk_weights, activation, b13, b2, alpha, limit)


def moe_topk(logits: torch.Tensor, k: int, router: str = "softmax", renormalize: bool = False,
             correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
             scale: float = 1.0):
    """A MoE router's logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in logits' dtype):
    "softmax" (Qwen3-MoE: softmax over all, top k, renormalised if `renormalize`), "topk_softmax"
    (gpt-oss: top k logits, softmax over them) or "grouped_sigmoid" (DeepSeek-V3's group-limited
    sigmoid router, which alone takes correction_bias, n_group, topk_group and scale). See
    reference.moe_topk; one launch on CUDA."""
    return _impl("moe_topk", logits)(logits, k, router, renormalize, correction_bias, n_group, topk_group, scale)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times weight [N, K] (+ bias) -> [T, N], as F.linear. On CUDA one row of bf16/fp16
    inside a CUDA graph capture reads the weight through a Triton GEMV (matvec.py), faster than
    cuBLAS at batch 1; every other call is F.linear."""
    return _impl("linear", x)(x, weight, bias)
