"""The torch reference kernels against SDPA on the same K/V laid out contiguously (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref
from tierkv.kernels.testing import cu_seqlens, make_paged


def sdpa_one(q, k, v, q_pos, scale, window=None):
    """q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D] by torch SDPA with an explicit mask."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1).double()   # [Hq, L, D]
    v = v.repeat_interleave(group, 1).transpose(0, 1).double()
    kpos = torch.arange(k.shape[1])
    mask = kpos[None, :] <= q_pos[:, None]                        # [n, L]
    if window is not None:
        mask &= kpos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_matches_sdpa(group, window):
    g = torch.Generator().manual_seed(group)
    lens, hkv, d, bs = [1, 17, 33, 64], 2, 16, 16
    pb = make_paged(lens, hkv, d, bs, generator=g)
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    out = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3, window)
    for b, n in enumerate(lens):
        want = sdpa_one(q[b : b + 1], pb.keys[b], pb.values[b], torch.tensor([n - 1]), 0.3, window)
        torch.testing.assert_close(out[b : b + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_matches_sdpa_with_cached_prefix(window):
    g = torch.Generator().manual_seed(1)
    lens, q_lens, hkv, d, bs = [5, 40, 19], [5, 13, 1], 2, 8, 8
    pb = make_paged(lens, hkv, d, bs, generator=g)
    q = torch.randn(sum(q_lens), hkv * 4, d, generator=g)
    cu = cu_seqlens(q_lens)
    out = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.25, window)
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = sdpa_one(q[rows], pb.keys[b], pb.values[b], torch.arange(n - m, n), 0.25, window)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)


def test_prefill_of_one_token_is_decode():
    g = torch.Generator().manual_seed(2)
    pb = make_paged([9, 30], 1, 8, 4, generator=g)
    q = torch.randn(2, 2, 8, generator=g)
    dec = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    pre = ref.paged_prefill(q, pb.kv, pb.block_tables, cu_seqlens([1, 1]), pb.seq_lens, 1.0)
    torch.testing.assert_close(dec, pre)


def test_kv_write_puts_tokens_in_slots_and_skips_minus_one():
    kv = torch.zeros(4, 2, 4, 2, 3)
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    slots = torch.tensor([13, -1, 2])
    ref.kv_write(k, v, kv, slots)
    torch.testing.assert_close(kv[3, 0, 1], k[0])
    torch.testing.assert_close(kv[3, 1, 1], v[0])
    torch.testing.assert_close(kv[0, 0, 2], k[2])
    assert int((kv != 0).any(dim=(-1, -2)).sum()) == 4  # 2 tokens x (K, V), nothing else touched


def test_gather_scatter_round_trip():
    pool = torch.randn(3, 6, 2, 4, 2, 8)
    slots = torch.tensor([4, 0, 5])
    staged = torch.empty(3, 3, 2, 4, 2, 8)
    ref.gather_blocks(pool, slots, staged)
    torch.testing.assert_close(staged[0], pool[:, 4])
    fresh = torch.zeros_like(pool)
    ref.scatter_blocks(staged, fresh, slots)
    torch.testing.assert_close(fresh[:, slots], pool[:, slots])
    assert int(fresh[:, [1, 2, 3]].abs().sum()) == 0


def test_bad_inputs_say_what_is_wrong():
    pb = make_paged([4], 2, 8, 4)
    q = torch.randn(1, 3, 8)  # 3 query heads is not a multiple of 2 kv heads
    with pytest.raises(ShapeError, match="multiple of kv heads"):
        ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="dtype"):
        ref.paged_decode(torch.randn(1, 2, 8).half(), pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="cu_seqlens_q"):
        ref.paged_prefill(torch.randn(1, 2, 8), pb.kv, pb.block_tables, torch.tensor([0], dtype=torch.int32), pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="slot_mapping"):
        ref.kv_write(torch.randn(2, 2, 8), torch.randn(2, 2, 8), pb.kv, torch.tensor([0]))
    with pytest.raises(ShapeError, match="sliding_window"):
        ref.paged_decode(torch.randn(1, 2, 8), pb.kv, pb.block_tables, pb.seq_lens, 1.0, sliding_window=0)


def test_kernels_load_alone_and_import_nothing_from_tierkv():
    # kernels/ is the bottom layer: `import tierkv.kernels` must not pull in the cache (the
    # package's top level imports lazily), and no kernel module may import tierkv
    import ast
    import pathlib
    import subprocess
    import sys

    code = "import sys, tierkv.kernels; print(sorted(m for m in sys.modules if m.startswith('tierkv')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "tierkv.cache" not in loaded and "tierkv.tiers" not in loaded and "tierkv.engine" not in loaded, loaded
    root = pathlib.Path(__file__).parent.parent / "kernels"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n == "tierkv" or n.startswith("tierkv.") for n in names), f"{path.name} imports {names}"


def test_the_cache_shape_error_is_a_kernel_shape_error():
    from tierkv import errors, kernels

    assert issubclass(errors.ShapeError, kernels.ShapeError) and issubclass(errors.ShapeError, errors.TierKVError)
    assert issubclass(kernels.ShapeError, ValueError)
