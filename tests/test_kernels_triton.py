"""The paged-attention, KV-write and block-copy Triton kernels against the torch reference, run on
CPU by the Triton interpreter (see interpreted.py: in a normal run this file's one test runs it
again in a child process). bf16 is GPU-tested (test_kernels_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tierkv.kernels import reference as ref  # noqa: E402
from tierkv.kernels.testing import cu_seqlens, make_paged  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("decode", "prefill", "write", "block_copy")


def _decode_case(tk, lens, hkv, group, d, bs, dtype, window=None, seed=0, **launch):
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, generator=g)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    got = tk.decode._paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window, **launch)
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _prefill_case(tk, lens, q_lens, hkv, group, d, bs, dtype, window=None, seed=0, **launch):
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, generator=g)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    cu = cu_seqlens(q_lens)
    got = tk.prefill._paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window, **launch)
    want = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_ragged_lengths_and_gqa(tk, dtype, group, splits):
    # lengths 0, 1, not a multiple of the block size, exactly one block, several blocks
    _decode_case(tk, [0, 1, 17, 16, 45], 2, group, 32, 16, dtype, num_splits=splits, block_n=16)


@pytest.mark.parametrize("bs,block_n", [(16, 32), (32, 16), (64, 16)])
def test_decode_tiles_across_and_within_pages(tk, bs, block_n):
    _decode_case(tk, [70, 5, 129], 2, 4, 16, bs, torch.float16, num_splits=2, block_n=block_n)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_decode_head_dims(tk, d):
    _decode_case(tk, [33, 9], 1, 4, d, 16, torch.float16, block_n=16)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sliding_window(tk, splits):
    _decode_case(tk, [1, 20, 77], 2, 4, 16, 16, torch.float32, window=9, num_splits=splits, block_n=16)


def test_decode_default_launch_choices(tk):
    _decode_case(tk, [300, 3], 2, 4, 64, 16, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_plain_chunked_and_prefix_hits(tk, dtype, group):
    # plain prefill (q_len == len), chunk after a cached prefix, one token, an empty request
    _prefill_case(tk, [21, 50, 9, 12], [21, 18, 1, 0], 1, group, 32, 16, dtype)


@pytest.mark.parametrize("bs,bm,bn", [(16, 16, 32), (32, 32, 16), (64, 16, 16)])
def test_prefill_tiles_across_and_within_pages(tk, bs, bm, bn):
    _prefill_case(tk, [100, 37], [70, 37], 2, 2, 16, bs, torch.float16, block_m=bm, block_n=bn)


@pytest.mark.parametrize("window", [1, 6, 40])
def test_prefill_sliding_window(tk, window):
    _prefill_case(tk, [45, 30], [30, 30], 2, 4, 16, 16, torch.float32, window=window)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_prefill_head_dims(tk, d):
    _prefill_case(tk, [40], [24], 1, 2, d, 16, torch.float16)


# a mixed batch: 1 new token over a long, page-misaligned context; 17 new over 23 cached; a cold
# sequence; one whose 4 cached tokens are shorter than any split's share (only the last split
# sees a key, the others have empty ranges). With 16-key tiles and 7 splits the first sequence's
# 64 fully visible keys give 4 splits work and leave 3 empty.
MIXED_LENS, MIXED_Q_LENS = [70, 40, 20, 9], [1, 17, 20, 5]


# every split count, each state of the window, and 7 splits (an empty one) both ways
@pytest.mark.parametrize("splits,window", [(1, None), (2, 37), (3, None), (7, None), (7, 37)])
def test_prefill_splits_match_reference(tk, splits, window):
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, 4, 64, 16, torch.float32, window,
                  num_splits=splits, block_m=16, block_n=16)


# a group of 3 packs 5 tokens into a 16-row tile and leaves its last row to no token
@pytest.mark.parametrize("group,pack,d", [(1, None, 128), (4, False, 64), (4, True, 128), (3, True, 64)])
def test_prefill_splits_gqa_packing_and_head_dims(tk, group, pack, d):
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, group, d, 16, torch.float16, None,
                  num_splits=3, pack=pack, block_m=16, block_n=16)


@pytest.mark.parametrize("bs,bm,bn,window", [(16, 32, 32, None), (32, 16, 16, 20), (16, 64, 16, None),
                                              (16, 128, 64, None)])
def test_prefill_splits_across_pages_and_tiles(tk, bs, bm, bn, window):
    # packed rows with 32-, 64- and 128-row tiles (a mixed step's): 8, 16 and 32 new tokens a
    # tile, the last tile part empty
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, 4, 32, bs, torch.float16, window,
                  num_splits=2, pack=True, block_m=bm, block_n=bn)


# Sequences of few new tokens beside longer ones (a mixed step's decodes beside a prompt chunk)
# take 16-row tiles where a packed launch's are taller: with a group of 4, 1 to 4 tokens (4 is
# exactly 16 rows); 5 tokens and more take the launch's.
@pytest.mark.parametrize("bm,window,splits", [(64, None, 2), (128, 37, 3), (32, None, 1)])
def test_prefill_short_sequences_take_short_tiles(tk, bm, window, splits):
    lens, q_lens = [70, 40, 50, 33, 9, 60], [1, 4, 5, 16, 9, 40]
    launch = tk.prefill.choose_launch(sum(q_lens), len(lens), 4, 1, 80, 32, torch.device("cpu"), block_m=bm,
                                      block_n=16, pack=True, num_splits=splits)
    assert tk.prefill.short_rows(launch) == 16
    for short in (True, False):
        _prefill_case(tk, lens, q_lens, 1, 4, 32, 16, torch.float16, window, num_splits=splits, pack=True,
                      block_m=bm, block_n=16, short=short)


def test_decode_automatic_launch(tk, monkeypatch):
    """The measured rule (kernels/decode.py choose_launch) on the Llama-3.1-8B layer of an H200."""
    monkeypatch.setattr(tk.decode, "sm_count", lambda device: 132)
    cpu, launch = torch.device("cpu"), tk.decode.decode_launch
    assert launch(1, 8, 128, 128, cpu) == (1, 128)            # one tile: not split
    assert launch(1, 8, 512, 128, cpu) == (8, 64)             # short: one 64-token tile a split
    # long: ~2 programs per SM (33 asked), 128-token tiles; 33 splits of whole tiles fill only 32 of
    # them (1024 tiles, 32 a split), so 32 launch, and no split is left empty
    assert launch(1, 8, 131072, 128, cpu) == (32, 128)
    assert launch(1, 8, 131072 - 128 * 31, 128, cpu) == (33, 128)  # 993 tiles: 31 a split leaves none empty
    assert launch(8, 8, 32768, 128, cpu) == (4, 128)
    assert launch(128, 8, 2048, 128, cpu) == (1, 64)          # the batch alone fills the GPU
    assert launch(1, 8, 131072, 256, cpu) == (33, 32)         # wide heads keep small tiles
    assert launch(1, 8, 512, 128, cpu, num_splits=3, block_n=16) == (3, 16)  # the caller's, where given
    assert launch(1, 8, 32, 128, cpu, num_splits=8, block_n=16) == (2, 16)   # never more splits than tiles


def test_prefill_automatic_launch_splits_only_short_extends(tk, monkeypatch):
    monkeypatch.setattr(tk.prefill, "sm_count", lambda device: 132)     # an H200
    cpu = torch.device("cpu")
    choose = tk.prefill.choose_launch
    # Llama-3.1-8B: 32 q heads on 8 kv heads, d=128; a 3-token hit on 12K cached tokens
    hit = choose(3, 1, 32, 8, 12288, 128, cpu)
    assert (hit.block_m, hit.pack) == (16, 4) and hit.num_splits > 1
    assert 8 * hit.num_splits <= 2 * 132                       # about 2 programs per SM, no more
    assert hit.num_splits * 4 * hit.block_n <= 12288           # at least 4 tiles of work a split
    batch = choose(8 * 16, 8, 32, 8, 8192 + 16, 128, cpu)
    assert batch.pack == 4 and batch.num_splits > 1
    for n, tiles in ((4096, (128, 64, 4)), (16384, (256, 64, 8)), (32768, (256, 64, 8))):
        cold = choose(n, 1, 32, 8, n, 128, cpu)                # cold prefills keep their launch
        assert (cold.block_m, cold.block_n, cold.num_warps, cold.pack, cold.num_splits) == (*tiles, 1, 1)
    # a short cold prefill has nothing fully visible to split, however few its programs
    assert choose(300, 1, 32, 8, 304, 128, cpu).num_splits == 1
    # a mixed step: two 140-token chunks and a decode over ~8K-token histories (bench_rounds)
    # packs the group: 32 tokens of 4 heads a 128-row tile, 8 kv heads' tiles instead of 32 heads'
    mixed = choose(281, 3, 32, 8, 8336, 128, cpu)
    assert (mixed.block_m, mixed.pack, mixed.tokens_per_tile) == (128, 4, 32) and mixed.num_splits > 1
    # up to 512 new tokens a sequence; longer ones take one head a tile
    assert choose(512, 1, 32, 8, 8192, 128, cpu).pack == 4
    assert choose(513, 1, 32, 8, 8192, 128, cpu).pack == 1
    # a mixed graph's padded step, 64 tokens a sequence (2 decodes and a 140-token chunk in a
    # 256-token graph of 4 sequences): packed 128-row tiles too, not 64-row tiles of one head
    padded = choose(256, 4, 32, 8, 32768, 128, cpu)
    assert (padded.block_m, padded.pack) == (128, 4) and tk.prefill.short_rows(padded) == 16
    # where the group fits 128 rows the tiles fit the rows; wide heads stay unpacked past that
    assert (choose(32, 1, 32, 8, 8192, 128, cpu).block_m, choose(32, 1, 32, 8, 8192, 128, cpu).pack) == (128, 4)
    wide = choose(64, 1, 32, 8, 8192, 256, cpu)
    assert (wide.block_m, wide.block_n, wide.pack) == (64, 32, 1) and tk.prefill.short_rows(wide) == 0
    # cold prompts (unpacked tall tiles) take no short tiles: one tile size in their kernel
    assert tk.prefill.short_rows(choose(4096, 1, 32, 8, 4096, 128, cpu)) == 0


def test_prefill_automatic_splits_match_reference(tk, monkeypatch):
    monkeypatch.setattr(tk.prefill, "sm_count", lambda device: 64)
    choose, used = tk.prefill.choose_launch, []

    def recorded(*args, **kwargs):  # the launch the kernel really ran with
        used.append(choose(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(tk.prefill, "choose_launch", recorded)
    _prefill_case(tk, [300], [3], 2, 4, 64, 16, torch.float16)
    assert used[0].num_splits > 1 and used[0].pack == 4


def test_prefill_layers_of_a_batch_share_one_plan(tk, monkeypatch):
    """With a plans dict, the launch and tile map are made by the first layer and taken by the
    others (a window layer among them: the plan does not depend on it); another batch, or another
    head count, gets a plan of its own; every layer's output equals the reference's."""
    made = []
    tile_map = tk.prefill._tile_map

    def counted(*args):
        made.append(args[1:])
        return tile_map(*args)

    monkeypatch.setattr(tk.prefill, "_tile_map", counted)
    g = torch.Generator().manual_seed(3)
    lens, q_lens = [40, 7, 66], [5, 7, 30]
    cu, plans = cu_seqlens(q_lens), {}
    for layer, window in enumerate((None, 16, None)):
        pb = make_paged(lens, 2, 16, 16, dtype=torch.float32, generator=g)   # each layer's own pool
        q = torch.randn(sum(q_lens), 8, 16, generator=g)
        got = tk.prefill._paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.25, window, plans=plans)
        want = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.25, window)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert len(made) == 1 and len(plans) == 1
    q4 = torch.randn(sum(q_lens), 4, 16, generator=g)                    # 4 query heads: another launch
    tk.prefill._paged_prefill(q4, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.25, plans=plans)
    other = cu_seqlens([5, 7, 29])                                       # another batch
    shorter = pb.seq_lens - torch.tensor([0, 0, 1])
    tk.prefill._paged_prefill(q[:41], pb.kv, pb.block_tables, other, shorter, 0.25, plans=plans)
    assert len(made) == 3 and len(plans) == 3


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    data=st.data(),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 4, 8]),
    d=st.sampled_from([16, 32, 64]),
    bs=st.sampled_from([16, 32, 64]),
    window=st.sampled_from([None, 3, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_prefill_and_decode_random_shapes(tk, lens, data, hkv, group, d, bs, window, dtype):
    q_lens = [data.draw(st.integers(0, n), label="q_len") for n in lens]
    _prefill_case(tk, lens, q_lens, hkv, group, d, bs, dtype, window, block_m=16, block_n=16)
    _decode_case(tk, lens, hkv, group, d, bs, dtype, window, num_splits=data.draw(st.sampled_from([None, 2])), block_n=16)


def test_kv_write_matches_reference_and_skips(tk):
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2, 16, 2, 64, generator=g).half()
    want = kv.clone()
    k, v = torch.randn(2, 6, 2, 64, generator=g).half()
    slots = torch.tensor([79, -1, 0, 33, -1, 16])
    tk.write.kv_write(k, v, kv, slots)
    ref.kv_write(k, v, want, slots)
    assert torch.equal(kv, want)


def test_kv_write_strided_pool(tk):
    # a layer view of a layer-first pool [layers, blocks, 2, bs, h, d] is not contiguous per layer
    pool = torch.zeros(3, 4, 2, 8, 2, 16)
    want = pool.clone()
    k, v = torch.randn(2, 5, 2, 16)
    slots = torch.tensor([0, 9, 31, -1, 17])
    tk.write.kv_write(k, v, pool[1], slots)
    ref.kv_write(k, v, want[1], slots)
    assert torch.equal(pool, want)


def test_decode_reads_a_strided_layer_view(tk):
    g = torch.Generator().manual_seed(4)
    pb = make_paged([40, 7], 2, 32, 16, dtype=torch.float16, generator=g)
    pool = torch.zeros(2, *pb.kv.shape, dtype=torch.float16)
    pool[1] = pb.kv
    q = torch.randn(2, 8, 32, generator=g).half()
    got = tk.decode._paged_decode(q, pool[1], pb.block_tables, pb.seq_lens, 0.2, num_splits=2, block_n=16)
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


def test_block_gather_scatter_round_trip(tk):
    pool = torch.randn(3, 9, 2, 16, 2, 64).half()
    slots = torch.tensor([7, 0, 3, 8])
    staged = torch.empty(4, 3, 2, 16, 2, 64).half()
    tk.block_copy.gather_blocks(pool, slots, staged)
    assert torch.equal(staged, ref.gather_blocks(pool, slots, torch.empty_like(staged)))
    fresh = torch.zeros_like(pool)
    tk.block_copy.scatter_blocks(staged, fresh, slots)
    assert torch.equal(fresh[:, slots], pool[:, slots])
    assert not fresh[:, [1, 2, 4, 5, 6]].any()


def test_copy_blocks_between_strided_layer_views(tk):
    host = torch.randn(9, 3, 2, 16, 2, 64).half()  # L2-like: [slots, layers, 2, bs, h, d]
    staging = torch.zeros(6, 2, 16, 2, 64).half()
    src, rows = torch.tensor([8, 0, 5]), torch.tensor([4, 1, 2])
    tk.block_copy.copy_blocks(host[:, 1], src, staging, rows)  # layer 1: rows strided by 3 layers
    assert torch.equal(staging[rows], host[src, 1])
    assert not staging[[0, 3, 5]].any()


def test_dispatch_env_forces_triton(tk, monkeypatch):
    import tierkv.kernels as K

    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    pb = make_paged([5], 1, 16, 16)
    q = torch.randn(1, 2, 16)
    assert K.backend_for(q) == "triton"
    torch.testing.assert_close(K.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3),
                               ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3))
    monkeypatch.setenv("TIERKV_KERNELS", "reference")
    assert K.backend_for(q) == "reference"


@pytest.mark.parametrize("window", [None, 900])
def test_decode_programs_steal_the_tiles_of_long_sequences(tk, window):
    """A split launch's programs read a share of a long sequence's tiles, then take the rest by
    ticket (1100 tokens: 69 tiles of 16 over 3 splits, >= 16 tiles a split); the short ones split
    statically. Twice in a row, so the second call finds the ticket counters zeroed by the first."""
    lens, hkv = [1100, 37, 0, 803], 2
    for seed in (0, 1):
        _decode_case(tk, lens, hkv, 4, 16, 16, torch.float32, window, seed=seed, num_splits=3, block_n=16, steal=True)
    counters = tk.decode.ticket_counters(torch.device("cpu"), len(lens) * hkv)
    assert counters.abs().sum().item() == 0
    with pytest.raises(ValueError, match="steal=True needs a split launch"):
        _decode_case(tk, lens, hkv, 4, 16, 16, torch.float32, num_splits=1, block_n=16, steal=True)


def test_decode_steals_by_default_where_the_table_is_long(tk):
    """With tickets already past every chunk, a launch that steals leaves the chunks unread: the
    default launch does so for a table as long as 16 tiles a split (3 splits of 16-token tiles: 768
    tokens), and keeps static splits for a shorter one."""
    hkv, cpu = 2, torch.device("cpu")
    for lens, steals in (([800, 37], True), ([700, 37], False)):
        g = torch.Generator().manual_seed(2)
        pb = make_paged(lens, hkv, 16, 16, dtype=torch.float32, generator=g)
        q = torch.randn(len(lens), hkv * 4, 16, generator=g)
        counters = tk.decode.ticket_counters(cpu, len(lens) * hkv)
        counters.fill_(1 << 20)
        try:
            got = tk.decode._paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.25, num_splits=3, block_n=16)
        finally:
            counters.zero_()
        want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.25)
        assert torch.allclose(got[1], want[1], **TOL[torch.float32])  # 37 tokens: never steals
        assert torch.allclose(got[0], want[0], **TOL[torch.float32]) != steals, lens


def test_decode_kernels_launched_apart(tk):
    # (bench_kernels times the split kernel and the merge apart) unsplit, the split kernel alone
    # is the whole attention; a kernel of another name is refused before any launch
    _decode_case(tk, [33, 9], 1, 4, 16, 16, torch.float32, num_splits=1, block_n=16, kernels=("split",))
    _decode_case(tk, [33, 9], 1, 4, 16, 16, torch.float32, num_splits=3, block_n=16, kernels=("merge", "split"))
    with pytest.raises(ValueError, match="'split' and/or 'merge'"):
        _decode_case(tk, [33, 9], 1, 4, 16, 16, torch.float32, kernels=("gather",))


def test_bad_inputs_fail_before_launch(tk):
    from tierkv.kernels import ShapeError

    pb = make_paged([5], 2, 16, 16)
    with pytest.raises(ShapeError, match="dtype"):
        tk.decode.paged_decode(torch.randn(1, 2, 16).half(), pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="multiple"):
        tk.prefill.paged_prefill(torch.randn(3, 3, 16), pb.kv, pb.block_tables, cu_seqlens([3]), pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="pool dtype"):
        tk.write.kv_write(torch.randn(1, 2, 16).half(), torch.randn(1, 2, 16).half(), pb.kv, torch.tensor([0]))


leave_only_the_child_run(globals())


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (16, 16, 128), (8, 1, 256)])
def test_compiled_variants_cover_every_launch_serving_can_pick(heads, kv_heads, head_dim):
    # compile_variants compiles launch_variants(); any launch choose_launch picks for a real batch
    # must be one of them, or a server would stall mid-run compiling it
    import random

    from tierkv.kernels import prefill

    dev = torch.device("cpu")
    compiled = {(v.block_m, v.block_n, v.num_warps, v.pack, v.num_splits == 1)
                for v in prefill.launch_variants(heads, kv_heads, head_dim, dev)}
    rng = random.Random(0)
    for _ in range(2000):
        num_seqs = rng.choice([1, 2, 3, 7, 16, 64, 200])
        tokens = num_seqs * rng.choice([1, 2, 3, 5, 16, 31, 40, 70, 100, 200, 900, 3000]) + rng.randrange(num_seqs)
        context = rng.choice([0, 100, 5000, 120_000])
        launch = prefill.choose_launch(tokens, num_seqs, heads, kv_heads, tokens // num_seqs + context, head_dim, dev)
        key = (launch.block_m, launch.block_n, launch.num_warps, launch.pack, launch.num_splits == 1)
        assert key in compiled, (tokens, num_seqs, context, launch)
