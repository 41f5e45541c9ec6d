"""Argument checks shared by the reference and the Triton kernels.

Every public kernel validates its inputs here first so that a wrong shape, dtype or device is a
clear `ShapeError` naming the argument, never a silent out-of-bounds read. This file only inspects
metadata (shapes, dtypes, devices); it must never read tensor contents, which would force a GPU
sync on the hot path. Like all of kernels/, it imports nothing from tierkv (tierkv.errors builds
on kernels/errors.py).
"""

from __future__ import annotations

import torch

from .errors import ShapeError


ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(msg: str) -> None:
    raise ShapeError(msg)


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        _fail(f"{name} has dtype {t.dtype}; use one of {names}")
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        _fail(f"all tensors must be on one device, got {listing}")


def check_kv(kv: object) -> tuple[int, int, int, int]:
    """kv: [num_blocks, 2, block_size, kv_heads, head_dim] -> (num_blocks, bs, Hkv, D)."""
    check_tensor("kv", kv, 5, ATTN_DTYPES)
    nb, two, bs, hkv, d = kv.shape
    if two != 2:
        _fail(f"kv dim 1 must be 2 (K, V), got shape {tuple(kv.shape)}")
    return nb, bs, hkv, d


def check_kv_write(k, v, kv, slot_mapping) -> None:
    _, _, hkv, d = check_kv(kv)
    check_tensor("k", k, 3, ATTN_DTYPES)
    check_tensor("v", v, 3, ATTN_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if k.shape != v.shape:
        _fail(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(k.shape[1:]) != (hkv, d):
        _fail(f"k/v are [T, {k.shape[1]}, {k.shape[2]}] but kv holds [.., {hkv}, {d}] heads x dim")
    if slot_mapping.shape[0] != k.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    if k.dtype != kv.dtype or v.dtype != kv.dtype:
        _fail(f"k/v dtype ({k.dtype}, {v.dtype}) must equal the pool dtype {kv.dtype}")
    check_same_device(k=k, v=v, kv=kv, slot_mapping=slot_mapping)


def check_attention(q, kv, block_tables, seq_lens, q_ndim_name: str) -> tuple[int, int, int]:
    """Common checks of paged_decode / paged_prefill; returns (Hq, Hkv, D)."""
    _, _, hkv, d = check_kv(kv)
    check_tensor(q_ndim_name, q, 3, ATTN_DTYPES)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    hq = q.shape[1]
    if q.shape[2] != d:
        _fail(f"q head_dim {q.shape[2]} != kv head_dim {d}")
    if hq % hkv != 0:
        _fail(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q.dtype != kv.dtype:
        _fail(f"q dtype {q.dtype} must equal the pool dtype {kv.dtype}")
    if block_tables.shape[0] != seq_lens.shape[0]:
        _fail(f"block_tables has {block_tables.shape[0]} rows for {seq_lens.shape[0]} sequences")
    return hq, hkv, d


def check_window(sliding_window) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        _fail(f"sliding_window must be None or a positive int, got {sliding_window!r}")


def check_sinks(sinks, q) -> None:
    """sinks: None, or one logit per query head [Hq] on q's device (gpt-oss's attention sinks), in
    any float dtype: the kernels read it in fp32 (a model holds it in its own dtype, as transformers)."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, 1, ATTN_DTYPES)
    if sinks.shape[0] != q.shape[1]:
        _fail(f"sinks must hold one logit per query head: [{q.shape[1]}], got {tuple(sinks.shape)}")
    check_same_device(q=q, sinks=sinks)


def check_decode(q, kv, block_tables, seq_lens, sliding_window, sinks=None) -> tuple[int, int, int]:
    dims = check_attention(q, kv, block_tables, seq_lens, "q")
    if q.shape[0] != seq_lens.shape[0]:
        _fail(f"q has {q.shape[0]} rows (one per sequence) but seq_lens has {seq_lens.shape[0]}")
    check_window(sliding_window)
    check_sinks(sinks, q)
    check_same_device(q=q, kv=kv, block_tables=block_tables, seq_lens=seq_lens)
    return dims


def check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window, sinks=None) -> tuple[int, int, int]:
    dims = check_attention(q, kv, block_tables, seq_lens, "q")
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        _fail(f"cu_seqlens_q needs B+1 = {seq_lens.shape[0] + 1} entries, got {cu_seqlens_q.shape[0]}")
    check_window(sliding_window)
    check_sinks(sinks, q)
    check_same_device(q=q, kv=kv, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    return dims


def check_context(context: int, num_tokens: int, block_tables, page: int) -> None:
    """A one-sequence batch's cached length must be >= 0 and leave its new tokens in the table."""
    room = block_tables.shape[1] * page
    if context < 0 or context + num_tokens > room:
        _fail(f"context {context} + {num_tokens} new tokens do not fit the block table's {room} tokens")


def check_blocks(pool, slots, staged, staged_name: str) -> None:
    """pool [layers, num_slots, 2, bs, h, d] and staged [n, layers, 2, bs, h, d] must agree."""
    check_tensor("pool", pool, 6, ATTN_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2))
    check_tensor("slots", slots, 1, INDEX_DTYPES)
    check_tensor(staged_name, staged, 6, (pool.dtype,))
    if staged.shape[0] != slots.shape[0]:
        _fail(f"{staged_name} holds {staged.shape[0]} blocks but slots lists {slots.shape[0]}")
    if staged.shape[1] != pool.shape[0] or tuple(staged.shape[2:]) != tuple(pool.shape[2:]):
        _fail(
            f"{staged_name} shape {tuple(staged.shape)} does not match pool {tuple(pool.shape)} "
            "(expected [n, layers, 2, block_size, kv_heads, head_dim])"
        )
    if slots.device != pool.device:
        _fail(f"slots must be on the pool's device {pool.device}, got {slots.device}")


def check_copy_blocks(src, src_slots, dst, dst_slots) -> None:
    """src [N, ...] and dst [M, ...] hold blocks of one shape and dtype; the slot lists pair up."""
    check_tensor("src_slots", src_slots, 1, INDEX_DTYPES)
    check_tensor("dst_slots", dst_slots, 1, INDEX_DTYPES)
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            _fail(f"{name} must be a tensor of blocks [n, ...], got {getattr(t, 'shape', type(t).__name__)}")
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.dtype != dst.dtype:
        _fail(f"src blocks {tuple(src.shape[1:])} {src.dtype} differ from dst blocks {tuple(dst.shape[1:])} {dst.dtype}")
    if src_slots.shape[0] != dst_slots.shape[0]:
        _fail(f"src_slots lists {src_slots.shape[0]} blocks but dst_slots {dst_slots.shape[0]}")
    if dst_slots.device != dst.device:
        _fail(f"dst_slots must be on dst's device {dst.device}, got {dst_slots.device}")


def _check_eps(eps) -> None:
    # a Python number: a tensor eps would have to be read on the host
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        _fail(f"eps must be a non-negative Python float, got {eps!r}")


def check_rms_norm(x, weight, eps, residual) -> None:
    """x [..., H] (any strides), weight [H] and an optional residual of x's shape, one dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        _fail(f"x must be a tensor [..., H], got {getattr(x, 'shape', type(x).__name__)}")
    check_tensor("x", x, x.dim(), ATTN_DTYPES)
    check_tensor("weight", weight, 1, ATTN_DTYPES)
    if weight.shape[0] != x.shape[-1]:
        _fail(f"weight has {weight.shape[0]} features but x is [..., {x.shape[-1]}] (shape {tuple(x.shape)})")
    if weight.dtype != x.dtype:
        _fail(f"weight dtype {weight.dtype} must equal x dtype {x.dtype} (the model's dtype)")
    _check_eps(eps)
    if residual is not None:
        check_tensor("residual", residual, x.dim(), (x.dtype,))
        if residual.shape != x.shape:
            _fail(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)


def check_rope_kv_write(
    q, k, v, cos, sin, kv, slot_mapping, q_norm=None, k_norm=None, eps=1e-6
) -> tuple[int, int, int, int]:
    """q [T, Hq, D], k/v [T, Hkv, D] (into kv as kv_write), cos/sin [T, D], and either no per-head
    norm or both q_norm and k_norm [D] in q's dtype with a Python eps; returns (T, Hq, Hkv, D)."""
    check_kv_write(k, v, kv, slot_mapping)
    check_tensor("q", q, 3, ATTN_DTYPES)
    tokens, hkv, d = k.shape
    if q.shape[0] != tokens:
        _fail(f"q has {q.shape[0]} tokens but k/v have {tokens}")
    if q.shape[2] != d:
        _fail(f"q head_dim {q.shape[2]} != k/v head_dim {d}")
    if q.dtype != kv.dtype:
        _fail(f"q dtype {q.dtype} must equal the pool dtype {kv.dtype}")
    if d % 2 != 0:
        _fail(f"head_dim must be even for rotate-half RoPE, got {d}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, 2, ATTN_DTYPES)
        if tuple(table.shape) != (tokens, d):
            _fail(f"{name} must be [T, D] = [{tokens}, {d}] (one row per token), got {tuple(table.shape)}")
        if table.dtype != q.dtype:
            _fail(f"{name} dtype {table.dtype} must equal q dtype {q.dtype} (cast once per forward, like transformers)")
    check_same_device(q=q, k=k, cos=cos, sin=sin, kv=kv)
    if (q_norm is None) != (k_norm is None):
        given, missing = ("q_norm", "k_norm") if k_norm is None else ("k_norm", "q_norm")
        _fail(f"q_norm and k_norm go together: got {given} without {missing}; pass both weights [D] "
              "(Qwen3, Gemma 3) or neither")
    if q_norm is not None:
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d,):
                got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                _fail(f"{name} must be [D] = [{d}] (one weight per head feature), got {got}")
            if w.dtype != q.dtype:
                _fail(f"{name} dtype {w.dtype} must equal q dtype {q.dtype} (the model's dtype)")
        _check_eps(eps)
        check_same_device(q=q, q_norm=q_norm, k_norm=k_norm)
    return tokens, q.shape[1], hkv, d


def check_silu_mul(gate_up) -> tuple[int, int]:
    """gate_up [T, 2 * I] (gate then up, any row stride); returns (T, I)."""
    check_tensor("gate_up", gate_up, 2, ATTN_DTYPES)
    if gate_up.shape[1] % 2 != 0:
        _fail(f"gate_up must be [T, 2 * I] (gate then up), got an odd width {gate_up.shape[1]}")
    return gate_up.shape[0], gate_up.shape[1] // 2


def check_top_k_top_p(logits, top_k, top_p) -> None:
    """logits [B, V] float; top_k None or [B] int; top_p None or [B] fp32; one device."""
    check_tensor("logits", logits, 2, ATTN_DTYPES)
    tensors = {"logits": logits}
    for name, t, dtypes in (("top_k", top_k, INDEX_DTYPES), ("top_p", top_p, (torch.float32,))):
        if t is None:
            continue
        check_tensor(name, t, 1, dtypes)
        if t.shape[0] != logits.shape[0]:
            _fail(f"{name} has {t.shape[0]} entries for {logits.shape[0]} rows of logits")
        tensors[name] = t
    check_same_device(**tensors)


FP8_DTYPES = (torch.float8_e4m3fn,)


def check_quantize(x, q, scales, x_name: str, q_name: str) -> None:
    """x [..., T, H, D] in an attention dtype, q the same shape in fp8, scales [..., H] fp32."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        _fail(f"{x_name} must be a tensor [..., tokens, kv_heads, head_dim], got {getattr(x, 'shape', type(x))}")
    check_tensor(x_name, x, x.dim(), ATTN_DTYPES)
    check_tensor(q_name, q, x.dim(), FP8_DTYPES)
    check_tensor("scales", scales, x.dim() - 2, (torch.float32,))
    if q.shape != x.shape:
        _fail(f"{q_name} must have {x_name}'s shape {tuple(x.shape)}, got {tuple(q.shape)}")
    if scales.shape != x.shape[:-3] + x.shape[-2:-1]:
        _fail(f"scales must be [..., kv_heads] = {tuple(x.shape[:-3] + x.shape[-2:-1])}, got {tuple(scales.shape)}")
    check_same_device(**{x_name: x, q_name: q, "scales": scales})


def check_gather_quantize(pool, slots, q, scales) -> None:
    """pool [layers, N, 2, bs, h, d] in an attention dtype, slots [n] on its device, q [n, layers,
    2, bs, h, d] fp8 and scales [n, layers, 2, h] fp32 (the fused gather+quantise and its inverse)."""
    check_tensor("pool", pool, 6, ATTN_DTYPES)
    if pool.shape[2] != 2:
        _fail(f"pool dim 2 must be 2 (K, V), got shape {tuple(pool.shape)}")
    check_tensor("slots", slots, 1, INDEX_DTYPES)
    check_tensor("q", q, 6, FP8_DTYPES)
    check_tensor("scales", scales, 4, (torch.float32,))
    want = (slots.shape[0], pool.shape[0], *pool.shape[2:])
    if tuple(q.shape) != want:
        _fail(f"q must be [n, layers, 2, block_size, kv_heads, head_dim] = {want}, got {tuple(q.shape)}")
    if tuple(scales.shape) != want[:3] + want[4:5]:
        _fail(f"scales must be [n, layers, 2, kv_heads] = {want[:3] + want[4:5]}, got {tuple(scales.shape)}")
    check_same_device(pool=pool, slots=slots, q=q, scales=scales)


def check_plane_views(planes, device) -> torch.device:
    """P views [N, bs, H, D] of one dtype, shape and strides, last axis dense, on one device that
    `device` (None: theirs) can address; returns that device (a PlaneTable's, where its pointers live)."""
    if not isinstance(planes, tuple) or not planes:
        _fail("a PlaneTable needs at least one plane [num_blocks, block_size, kv_heads, head_dim]")
    first = planes[0]
    for i, plane in enumerate(planes):
        if not isinstance(plane, torch.Tensor) or plane.dim() != 4:
            _fail(f"plane {i} must be a tensor [num_blocks, block_size, kv_heads, head_dim], "
                  f"got {getattr(plane, 'shape', type(plane).__name__)}")
        for what, mine, theirs in (("shape", plane.shape, first.shape), ("strides", plane.stride(), first.stride()),
                                   ("dtype", plane.dtype, first.dtype), ("device", plane.device, first.device)):
            if mine != theirs:
                _fail(f"plane {i} has {what} {_show(mine)} but plane 0 has {_show(theirs)}: "
                      "all planes of one table must share shape, strides, dtype and device")
    if first.shape[3] > 1 and first.stride(3) != 1:
        _fail(f"planes must be dense along head_dim (stride 1), got strides {tuple(first.stride())}: "
              "pass views whose last axis is the head dimension")
    if first.element_size() not in (1, 2, 4, 8):
        _fail(f"planes of dtype {first.dtype} ({first.element_size()} bytes) cannot be copied "
              "as 1, 2, 4 or 8-byte words")
    where = first.device if device is None else torch.device(device)
    if where.type == "cuda" and where.index is None and torch.cuda.is_available():
        where = torch.device("cuda", torch.cuda.current_device())
    if first.device.type == "cuda" and where != first.device:
        _fail(f"planes on {first.device} are addressed from their own GPU, not from {where}")
    if first.device.type == "cpu" and where.type == "cuda":
        unpinned = [i for i, plane in enumerate(planes) if not plane.is_pinned()]
        if unpinned:
            _fail(f"plane(s) {unpinned[:8]} are pageable host memory, which {where} cannot address: "
                  "pin them (tensor.pin_memory()) or build the table with device='cpu'")
    elif where.type != first.device.type:
        _fail(f"planes on {first.device} cannot be addressed from {where}")
    return where


def _show(value) -> str:
    return str(tuple(value)) if isinstance(value, (torch.Size, tuple)) else str(value)


def check_copy_planes(src, src_slots, dst, dst_slots, planes) -> tuple[int, int]:
    """Two PlaneTables of one block geometry and dtype (N may differ), a plane range inside both
    (None: all, when both hold as many), and slot lists of equal length on the device the copy
    runs on (the GPU where either table lives). Returns the range (first, end)."""
    from .planes import PlaneTable

    for name, table in (("src", src), ("dst", dst)):
        if not isinstance(table, PlaneTable):
            _fail(f"{name} must be a PlaneTable, got {type(table).__name__}")
    if src.block_shape != dst.block_shape or src.dtype != dst.dtype:
        _fail(f"src blocks [bs, H, D] = {list(src.block_shape)} {src.dtype} differ from dst blocks "
              f"{list(dst.block_shape)} {dst.dtype}")
    if planes is None:
        if src.num_planes != dst.num_planes:
            _fail(f"src holds {src.num_planes} planes and dst {dst.num_planes}: pass planes=(first, end)")
        first, end = 0, src.num_planes
    else:
        if (not isinstance(planes, tuple) or len(planes) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in planes)):
            _fail(f"planes must be a (first, end) tuple of ints, got {planes!r}")
        first, end = planes
        room = min(src.num_planes, dst.num_planes)
        if not 0 <= first <= end <= room:
            _fail(f"plane range [{first}, {end}) is outside [0, {room}) (src holds {src.num_planes} "
                  f"planes, dst {dst.num_planes})")
    check_tensor("src_slots", src_slots, 1, INDEX_DTYPES)
    check_tensor("dst_slots", dst_slots, 1, INDEX_DTYPES)
    if src_slots.shape[0] != dst_slots.shape[0]:
        _fail(f"src_slots lists {src_slots.shape[0]} blocks but dst_slots {dst_slots.shape[0]}")
    runs_on = src.device if src.device.type == "cuda" else dst.device
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.device != runs_on:
            _fail(f"{name} must be on {runs_on}, where the copy runs, got {slots.device}")
    return first, end


MOE_ACTIVATIONS = ("silu", "swigluoai")


def check_fused_moe(x, w13, w2, topk_ids, topk_weights, activation, b13, b2) -> tuple[int, int, int, int, int]:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_ids [T, k] int; topk_weights [T, k] float;
    b13 None or [E, 2I]; b2 None or [E, H]; weights and biases in x's dtype, all on one device.
    Returns (T, H, E, I, k). Expert ids are not checked against E here (that would read them):
    ids outside [0, E) are the caller's bug."""
    check_tensor("x", x, 2, ATTN_DTYPES)
    check_tensor("w13", w13, 3, (x.dtype,))
    check_tensor("w2", w2, 3, (x.dtype,))
    check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, ATTN_DTYPES)
    tokens, hidden = x.shape
    experts, two_inter, w_hidden = w13.shape
    inter = two_inter // 2
    if two_inter % 2 or w_hidden != hidden:
        _fail(f"w13 must be [E, 2 * I, H={hidden}] (each expert's gate rows, then its up rows), got {tuple(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, inter):
        _fail(f"w2 must be [E={experts}, H={hidden}, I={inter}], got {tuple(w2.shape)}")
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        _fail(f"topk_ids and topk_weights must both be [T={tokens}, k], got {tuple(topk_ids.shape)} and "
              f"{tuple(topk_weights.shape)}")
    if activation not in MOE_ACTIVATIONS:
        _fail(f"activation {activation!r} is not one of {', '.join(MOE_ACTIVATIONS)}")
    tensors = {"x": x, "w13": w13, "w2": w2, "topk_ids": topk_ids, "topk_weights": topk_weights}
    for name, bias, shape in (("b13", b13, (experts, two_inter)), ("b2", b2, (experts, hidden))):
        if bias is None:
            continue
        check_tensor(name, bias, 2, (x.dtype,))
        if tuple(bias.shape) != shape:
            _fail(f"{name} must be {list(shape)}, got {tuple(bias.shape)}")
        tensors[name] = bias
    check_same_device(**tensors)
    return tokens, hidden, experts, inter, topk_ids.shape[1]


MOE_ROUTERS = ("softmax", "topk_softmax", "grouped_sigmoid")


def check_moe_topk(logits, k, router, correction_bias=None, n_group=1, topk_group=1, scale=1.0) -> tuple[int, int]:
    """logits [T, E] float; k in [1, E]; router one of MOE_ROUTERS. "grouped_sigmoid" (DeepSeek-V3) also
    takes correction_bias [E] (float, on logits' device) and n_group groups of E / n_group >= 2 experts, of
    which topk_group in [1, n_group] hold the k; the other routers take none of these. Returns (T, E)."""
    check_tensor("logits", logits, 2, ATTN_DTYPES)
    tokens, experts = logits.shape
    if not isinstance(k, int) or not 0 < k <= experts:
        _fail(f"k (experts per token) must be an int in [1, {experts}] for logits [T, {experts}], got {k!r}")
    if router not in MOE_ROUTERS:
        _fail(f"router {router!r} is not one of {', '.join(MOE_ROUTERS)}")
    if router != "grouped_sigmoid":
        if correction_bias is not None or (n_group, topk_group, scale) != (1, 1, 1.0):
            _fail(f"correction_bias, n_group, topk_group and scale apply to router 'grouped_sigmoid' only, not "
                  f"{router!r}; leave them at their defaults")
        return tokens, experts
    if correction_bias is None:
        _fail("router 'grouped_sigmoid' needs correction_bias [E] (the gate's e_score_correction_bias)")
    check_tensor("correction_bias", correction_bias, 1, ATTN_DTYPES)
    if correction_bias.shape[0] != experts:
        _fail(f"correction_bias must be [{experts}], one per expert, got {tuple(correction_bias.shape)}")
    check_same_device(logits=logits, correction_bias=correction_bias)
    problem = grouped_router_problem(experts, k, n_group, topk_group)
    if problem:
        _fail(problem)
    return tokens, experts


def grouped_router_problem(experts: int, k: int, n_group, topk_group) -> str | None:
    """What is wrong with a group-limited router's groups (DeepSeek-V3: k experts from the
    topk_group best of n_group groups of E / n_group >= 2), or None; the one home of this rule
    (engine/moe.MoESpec checks a config.json by it too)."""
    per_group = experts // n_group if isinstance(n_group, int) and n_group > 0 else 0
    if per_group < 2 or per_group * n_group != experts:
        return f"n_group {n_group!r} must divide the {experts} experts into groups of two or more"
    if not isinstance(topk_group, int) or not 0 < topk_group <= n_group:
        return f"topk_group {topk_group!r} must be in [1, n_group {n_group}]"
    if k > topk_group * per_group:
        return (f"topk_group {topk_group} groups of {per_group} experts cannot hold k {k} experts; raise "
                f"topk_group or lower k")
    return None


def check_mla_decode(q_latent, q_pe, kv, block_tables, seq_lens) -> tuple[int, int, int]:
    """Absorbed MLA decode: q_latent [B, H, L], q_pe [B, H, R] over a latent pool kv
    [num_blocks, 2, bs, 1, D] with L + R == 2 * D (a token's latent split over the K and V planes).
    Returns (H, L, R)."""
    _, _, hkv, d = check_kv(kv)
    check_tensor("q_latent", q_latent, 3, ATTN_DTYPES)
    check_tensor("q_pe", q_pe, 3, (q_latent.dtype,))
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    batch, heads, lat = q_latent.shape
    rope = q_pe.shape[2]
    if tuple(q_pe.shape[:2]) != (batch, heads):
        _fail(f"q_pe must be [B={batch}, H={heads}, rope], got {tuple(q_pe.shape)}")
    if hkv != 1:
        _fail(f"an MLA latent pool holds one latent per token: kv_heads must be 1, got {hkv}")
    if lat + rope != 2 * d:
        _fail(f"kv_lora_rank {lat} + rope dim {rope} must fill the pool's two planes of {d} (= {2 * d})")
    if lat < d:
        _fail(f"kv_lora_rank {lat} must be at least half the latent ({d}): the rope part sits in the V plane")
    if q_latent.dtype != kv.dtype:
        _fail(f"q_latent dtype {q_latent.dtype} must equal the pool dtype {kv.dtype}")
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        _fail(f"block_tables ({block_tables.shape[0]} rows) and seq_lens ({seq_lens.shape[0]}) need one entry "
              f"per query row ({batch})")
    check_same_device(q_latent=q_latent, q_pe=q_pe, kv=kv, block_tables=block_tables, seq_lens=seq_lens)
    return heads, lat, rope
