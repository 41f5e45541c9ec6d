"""The engine-owned L1 mode of the cache (TieredKVCache(engine_blocks=N)), on CPU: the engine
gives its block ids, tierkv records every L1<->L2 copy (take_moves), the engine runs them on its
own KV pages (recorded_moves.run_moves over a BlockMover) and reports them (moves_done). The pages are
vLLM 0.32's per-layer [N, kv_heads, block_size, 2*head_dim] tensors, CPU and CUDA stride orders,
and L2 a shared memory file that the engine side maps (HostPool.attach), as in tierkv's vLLM
connector. Tensor parallelism has its own file (test_engine_blocks_tp.py)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import ConfigError, UsageError
from tierkv.recorded_moves import L1_TO_L2, L2_TO_L1, run_moves
from tierkv.tiers import DevicePool, HostPool
from tierkv.transfer import BlockMover

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
BS, H, D = LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
BLOCKS = 16  # the engine's KV blocks
PROMPT = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks and one token


def l2_bytes(blocks: int) -> int:
    return blocks * LAYOUT.bytes_per_block


class Engine:
    """An engine's side: its KV pages, one tensor per layer in vLLM's layout, filled at random,
    and the mover that runs the cache's recorded copies on them over L2 (`l2`: the cache's own
    pool, or a shared memory file that this side maps as another process would)."""

    def __init__(self, l2: HostPool | str, kv_layout: str = "vllm_cpu", nhd: bool = False) -> None:
        shape = (BLOCKS, BS, H, 2 * D) if nhd else (BLOCKS, H, BS, 2 * D)
        # nhd: tokens-outer strides, as vLLM's FlashAttention pages: [N, B, H, 2D] seen as [N, H, B, 2D]
        self.pages = {f"model.layers.{i}.self_attn.attn": torch.randn(shape).transpose(1, 2) if nhd
                      else torch.randn(shape) for i in range(LAYOUT.num_layers)}
        l2 = HostPool.attach(LAYOUT, l2) if isinstance(l2, str) else l2
        self.mover = BlockMover(DevicePool.of_buffers(LAYOUT, self.pages, kv_layout), l2, warm_up=False)

    def step(self, cache: TieredKVCache) -> list:
        """One step's copies, as an engine runs them: loads before its forward, saves after, then
        the report. Returns the batch's moves."""
        number, moves = cache.take_moves()
        run_moves(self.mover, moves, kinds=(L2_TO_L1,))
        run_moves(self.mover, moves, kinds=(L1_TO_L2,))
        cache.moves_done(number)
        return moves

    def save(self, cache: TieredKVCache, tokens: list[int], slots: list[int]) -> dict[str, torch.Tensor]:
        """A cold request in blocks `slots`, its KV computed, saved and freed; returns its full blocks' KV."""
        seq = cache.allocate(tokens, slots=slots)
        assert seq.num_cached_tokens == 0
        cache.commit(seq, tokens)
        saved = self.blocks(slots[: len(tokens) // BS])
        self.step(cache)
        cache.free(seq)
        return saved

    def blocks(self, ids: list[int]) -> dict[str, torch.Tensor]:
        return {name: t[ids].clone() for name, t in self.pages.items()}

    def scramble(self) -> None:
        for t in self.pages.values():
            t.copy_(torch.randn(t.shape))


def engine_cache(config: CacheConfig, **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, config, model="engine-blocks-test", engine_blocks=BLOCKS, **kw)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def shm(request):
    """A shared memory path of this test's own; gone afterwards (close() removes it)."""
    path = f"/dev/shm/tierkv-test-{os.getpid()}-{request.node.name.replace('[', '-').strip(']')}"
    yield path
    leftover = os.path.exists(path)
    if leftover:
        os.unlink(path)
    assert not leftover, f"{path} outlived its cache"


# ---------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("kv_layout,nhd", [("vllm_cpu", False), ("vllm_paged", False), ("vllm_paged", True)],
                         ids=["vllm_cpu", "vllm_paged-HND", "vllm_paged-NHD"])
def test_blocks_saved_from_some_engine_blocks_load_into_others_bit_for_bit(shm, kv_layout, nhd):
    with engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=shm)) as cache:
        engine = Engine(shm, kv_layout, nhd)
        seq = cache.allocate(PROMPT, slots=[5, 6, 7, 9])
        assert seq.num_cached_tokens == 0
        cache.commit(seq, PROMPT)
        saved = engine.blocks([5, 6, 7])
        moves = engine.step(cache)
        # the three full blocks, not the partial fourth, each into an L2 slot of its own
        assert [(k, src) for k, src, _ in moves] == [(L1_TO_L2, [5, 6, 7])]
        l2_slots = moves[0][2]
        assert len(set(l2_slots)) == 3
        # L2 holds tierkv's block layout [layers, 2, bs, heads, head_dim]: vLLM's CUDA pages hold
        # K then V in the last axis and are shared with every other layout; its CPU pages hold K
        # packed for the vector unit, copied as they are: [heads, bs, 2D] read as [heads, 2, bs, D]
        for i, page in enumerate(saved.values()):
            for block, slot in zip(page, l2_slots):
                if kv_layout == "vllm_paged":
                    k, v = block.transpose(0, 1)[..., :D], block.transpose(0, 1)[..., D:]
                else:
                    k, v = (block.reshape(H, 2, BS, D)[:, c].transpose(0, 1) for c in (0, 1))
                assert torch.equal(cache.l2.kv[slot, i, 0], k) and torch.equal(cache.l2.kv[slot, i, 1], v)
        cache.free(seq)

        engine.scramble()
        seq = cache.allocate(PROMPT, slots=[0, 1, 2, 3])
        assert seq.num_cached_tokens == 12 and seq.cached_by_tier == {"l1": 0, "l2": 12, "l3": 0}
        moves = engine.step(cache)
        assert moves == [(L2_TO_L1, l2_slots, [0, 1, 2])]
        assert same(engine.blocks([0, 1, 2]), saved)
        cache.free(seq)
        assert not cache.live_sequences()


def test_a_block_is_found_only_once_its_save_is_reported():
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        engine = Engine(cache.l2)
        seq = cache.allocate(PROMPT, slots=[0, 1, 2, 3])
        cache.commit(seq, PROMPT)
        assert cache.match(PROMPT).tokens == 0  # recorded, not copied yet
        number, moves = cache.take_moves()
        assert cache.match(PROMPT).tokens == 0  # handed to the engine: still not copied
        # a second request of the same prompt meanwhile neither loads the blocks (the L2 slots
        # are empty yet) nor saves them a second time
        other = cache.allocate(PROMPT, slots=[4, 5, 6, 7])
        assert other.num_cached_tokens == 0
        cache.commit(other, PROMPT)
        later, nothing = cache.take_moves()
        assert nothing == []
        run_moves(engine.mover, moves)
        cache.moves_done(number)
        assert cache.match(PROMPT).tokens == 12
        assert cache.stats()["tiers"]["l2"]["used_blocks"] == 3
        for s in (seq, other):
            cache.free(s)


def test_the_engines_own_prefix_is_not_loaded_again():
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        engine = Engine(cache.l2)
        saved = engine.save(cache, PROMPT, [0, 1, 2, 3])

        loaded = cache.stats()["tiers"]["l2"]["blocks_out"]
        # the engine's prefix cache holds the first block (in its block 8): tierkv loads the other two
        seq = cache.allocate(PROMPT, slots=[8, 9, 10, 11], computed=BS)
        assert seq.num_cached_tokens == 12
        assert seq.cached_by_tier == {"l1": 0, "l2": 8, "l3": 0}  # what tierkv served
        moves = engine.step(cache)
        assert [(k, dst) for k, _, dst in moves] == [(L2_TO_L1, [9, 10])]
        assert cache.stats()["tiers"]["l2"]["blocks_out"] - loaded == 2
        assert same(engine.blocks([9, 10]), {n: t[1:] for n, t in saved.items()})
        cache.commit(seq, PROMPT)
        assert engine.step(cache) == []  # nothing new to save either
        cache.free(seq)

        # all of the hit in the engine already: nothing moves, and the engine starts where it is
        seq = cache.allocate(PROMPT, slots=[12, 13, 14, 15], computed=12)
        assert seq.num_cached_tokens == 12 and engine.step(cache) == []
        cache.free(seq)


def test_a_block_the_engine_keeps_no_memory_for_is_neither_loaded_nor_saved():
    """vLLM's sliding-window groups hold no block for positions their window has left (its null
    block, given to tierkv as -1): a hit loads only the blocks the engine holds, and a commit saves
    only those (never the null block's bytes as someone's KV)."""
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        engine = Engine(cache.l2)
        saved = engine.save(cache, PROMPT, [0, 1, 2, 3])
        loaded = cache.stats()["tiers"]["l2"]["blocks_out"]
        seq = cache.allocate(PROMPT, slots=[-1, 9, 10, 11])
        assert seq.num_cached_tokens == 12
        moves = engine.step(cache)
        assert [(k, dst) for k, _, dst in moves] == [(L2_TO_L1, [9, 10])]
        assert cache.stats()["tiers"]["l2"]["blocks_out"] - loaded == 2
        assert same(engine.blocks([9, 10]), {n: t[1:] for n, t in saved.items()})
        cache.free(seq)

    other = list(range(500, 500 + 3 * BS + 1))
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        engine = Engine(cache.l2)
        seq = cache.allocate(other, slots=[-1, 4, 5, 6])
        cache.commit(seq, other)
        assert [(k, src) for k, src, _ in engine.step(cache)] == [(L1_TO_L2, [4, 5])]
        cache.free(seq)


def test_blocks_given_a_chunk_at_a_time_are_saved_and_found_whole():
    prompt = list(range(300, 300 + 5 * BS + 1))  # 5 full blocks and one token
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        engine = Engine(cache.l2)
        # the engine allocates the first chunk's blocks only (a chunked prefill)
        seq = cache.allocate(prompt, slots=[3, 4])
        assert seq.num_tokens == 2 * BS and seq.num_cached_tokens == 0
        cache.commit(seq, prompt[: 2 * BS])
        assert [(k, src) for k, src, _ in engine.step(cache)] == [(L1_TO_L2, [3, 4])]
        with pytest.raises(UsageError, match=r"append\(\) of 13 tokens needs 4 more block ids \(slots=\), got 2"):
            cache.append(seq, len(prompt) - 2 * BS, slots=[10, 11])
        assert seq.num_tokens == 2 * BS and seq.slots == [3, 4]  # the refused call changed nothing
        cache.append(seq, len(prompt) - 2 * BS, slots=[10, 11, 12, 13])
        assert seq.num_tokens == len(prompt) and seq.slots == [3, 4, 10, 11, 12, 13]
        cache.commit(seq, prompt)
        assert [(k, src) for k, src, _ in engine.step(cache)] == [(L1_TO_L2, [10, 11, 12])]
        saved = engine.blocks([3, 4, 10, 11])
        cache.free(seq)

        engine.scramble()
        seq = cache.allocate(prompt, slots=[0, 1, 2, 5, 6, 7])
        assert seq.num_cached_tokens == 5 * BS
        engine.step(cache)
        assert same(engine.blocks([0, 1, 2, 5]), saved)
        cache.free(seq)

        # a first chunk shorter than the hit takes what its blocks hold; the rest is the
        # engine's to compute, and is not saved again
        seq = cache.allocate(prompt, slots=[8, 9])
        assert seq.num_cached_tokens == 2 * BS
        assert [(k, dst) for k, _, dst in engine.step(cache)] == [(L2_TO_L1, [8, 9])]
        cache.append(seq, len(prompt) - 2 * BS, slots=[12, 13, 14, 15])
        cache.commit(seq, prompt)
        assert engine.step(cache) == []
        cache.free(seq)


def test_l2_slots_being_loaded_from_are_not_reused_before_the_load_is_reported():
    with engine_cache(CacheConfig(l2=l2_bytes(4))) as cache:  # room for 4 blocks
        engine = Engine(cache.l2)
        saved = engine.save(cache, PROMPT, [0, 1, 2, 3])

        reader = cache.allocate(PROMPT, slots=[4, 5, 6, 7])
        cache.free(reader)  # freed before its copies ran: they are still owed
        loads, load_moves = cache.take_moves()
        assert [k for k, *_ in load_moves] == [L2_TO_L1]
        held = set(load_moves[0][1])
        # a new prompt of 4 blocks finds L2 full: only the slot nothing loads from is free
        other = list(range(700, 700 + 4 * BS + 1))
        seq = cache.allocate(other, slots=[8, 9, 10, 11, 12])
        cache.commit(seq, other)
        saves, save_moves = cache.take_moves()
        assert len(save_moves) == 1 and save_moves[0][0] == L1_TO_L2
        assert len(save_moves[0][2]) == 1 and not held & set(save_moves[0][2])
        assert cache.match(PROMPT).tokens == 12  # still indexed in L2
        # even run in the worse order (the later batch's save first), the load reads what was saved
        run_moves(engine.mover, save_moves)
        run_moves(engine.mover, load_moves)
        cache.moves_done(saves)
        assert same(engine.blocks([4, 5, 6]), saved)
        cache.free(seq)

        # reported: those slots may go now, to the next blocks that need room
        third = list(range(900, 900 + 3 * BS + 1))
        seq = cache.allocate(third, slots=[13, 14, 15])
        cache.commit(seq, third)
        assert [len(dst) for _, _, dst in engine.step(cache)] == [3]
        cache.free(seq)


# ---------------------------------------------------------------------------- shared memory L2

def test_a_shared_l2_is_one_set_of_bytes_owner_only_and_gone_at_close(shm):
    with open(shm, "w"):  # left by an earlier run, open to everyone: replaced, not reused
        pass
    os.chmod(shm, 0o666)
    cache = engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=shm))
    try:
        st = os.stat(shm)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_size == l2_bytes(8)
        first, second = HostPool.attach(LAYOUT, shm), HostPool.attach(LAYOUT, shm)
        assert first.num_blocks == second.num_blocks == 8
        block = torch.randn(LAYOUT.block_shape)
        first.kv[3] = block
        assert torch.equal(second.kv[3], block) and torch.equal(cache.l2.kv[3], block)
        cache.l2.kv[5] = -block
        assert torch.equal(first.kv[5], -block)
    finally:
        cache.close()
    assert not os.path.exists(shm)
    assert torch.equal(first.kv[3], block)  # a mapping made before stays valid


def test_a_shared_l2_that_cannot_be_made_or_mapped_is_a_config_error(shm, tmp_path):
    # a folder without room (Docker's /dev/shm is 64 MiB): both sizes named, and how to get room
    whole_blocks = 64 * 2**20 // LAYOUT.bytes_per_block * LAYOUT.bytes_per_block  # what 64 MiB of L2 holds
    with pytest.raises(ConfigError, match=rf"needs {whole_blocks} bytes \(0\.06 GiB\) in /proc, which has 0 bytes "
                                          r"\(0\.00 GiB\) free: lower l2.*--shm-size"):
        engine_cache(CacheConfig(l2="64MiB", l2_file="/proc/tierkv-l2"))
    with pytest.raises(ConfigError, match="in a folder that does not exist"):
        engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=str(tmp_path / "missing" / "l2")))
    # mapping a file that is not an L2 pool of this layout's blocks
    with pytest.raises(ConfigError, match=r"is not an L2 pool .*\(missing\).*same KV layout and run first"):
        HostPool.attach(LAYOUT, shm)
    with open(shm, "wb") as f:
        f.write(b"\0" * (LAYOUT.bytes_per_block + 4))
    with pytest.raises(ConfigError, match=rf"is not an L2 pool of blocks of {LAYOUT.bytes_per_block} bytes"):
        HostPool.attach(LAYOUT, shm)
    os.unlink(shm)


def test_a_cache_that_fails_to_start_removes_its_shared_l2(shm):
    """An L3 refused after L2 was made: the L2 file (GiBs of shared memory) goes with the cache."""
    with pytest.raises(ConfigError, match="endpoint"):
        engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=shm, l3=["s3://bucket/p?endpoint=not-a-url"]))
    assert not os.path.exists(shm)


# ---------------------------------------------------------------------------- L3

def test_write_through_reaches_l3_once_reported_and_a_new_cache_loads_it(tmp_path, shm):
    url = f"file://{tmp_path}/l3"
    with engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=shm, l3=[url])) as writer:
        engine = Engine(shm)
        seq = writer.allocate(PROMPT, slots=[5, 6, 7, 8])
        writer.commit(seq, PROMPT)
        saved = engine.blocks([5, 6, 7])
        number, moves = writer.take_moves()
        assert writer.flush(10) and writer.stats()["tiers"]["l3"]["blocks_in"] == 0  # not in L2 yet
        run_moves(engine.mover, moves)
        writer.moves_done(number)
        assert writer.flush(10) and writer.stats()["tiers"]["l3"]["blocks_in"] == 3
        writer.free(seq)

    with engine_cache(CacheConfig(l2=l2_bytes(8), l2_file=shm + "-reader", l3=[url])) as reader:
        engine = Engine(shm + "-reader")
        m = reader.match(PROMPT)
        assert m.by_tier == {"l1": 0, "l2": 0, "l3": 12}
        assert reader.prefetch(m, 10).wait(10)
        seq = reader.allocate(PROMPT, slots=[1, 2, 3, 4])
        assert seq.num_cached_tokens == 12 and seq.cached_by_tier["l3"] == 12
        assert [(k, dst) for k, _, dst in engine.step(reader)] == [(L2_TO_L1, [1, 2, 3])]
        assert same(engine.blocks([1, 2, 3]), saved)
        reader.free(seq)
    assert not os.path.exists(shm + "-reader")


@pytest.mark.parametrize("written_as", ["", "vllm_cpu-vec"])
def test_kv_format_names_blocks_apart(tmp_path, written_as):
    """Pages of another format (vLLM's CPU pages pack K for the vector unit) are never read back
    as plain K and V, nor the reverse: an L3 hit only within one format."""
    url = f"file://{tmp_path}/l3"
    with engine_cache(CacheConfig(l2=l2_bytes(8), l3=[url]), kv_format=written_as) as writer:
        Engine(writer.l2).save(writer, PROMPT, [0, 1, 2, 3])
        assert writer.flush(10)
    for read_as in ("", "vllm_cpu-vec"):
        with engine_cache(CacheConfig(l2=l2_bytes(8), l3=[url]), kv_format=read_as) as reader:
            assert reader.match(PROMPT).tokens == (12 if read_as == written_as else 0), read_as


def test_a_hybrid_model_keeps_one_cache_per_group_of_layers(tmp_path):
    """A model whose layers form groups (full attention, a sliding window: vLLM's hybrid KV-cache
    groups) keeps one cache per group, named apart by kv_format, each following the group's own
    block ids: a hit loads the full group's whole prefix and the window group's blocks its window
    still reads (-1 where the engine keeps none), and one group's blocks are never another's, even
    in a shared L3 and with equal shapes (docs/custom_engine.md, "Hybrid models")."""
    url = f"file://{tmp_path}/l3"
    groups = {"g0": None, "g1w4": 4}  # the full group, and a group of 4-token windows
    caches = {tag: engine_cache(CacheConfig(l2=l2_bytes(8), l3=[url], write_policy="write_through"), kv_format=tag)
              for tag in groups}
    engines = {tag: Engine(cache.l2) for tag, cache in caches.items()}
    saved = {tag: engines[tag].save(caches[tag], PROMPT, [0, 1, 2, 3]) for tag in groups}
    more = PROMPT + [7, 8, 9]  # the same prefix, longer: block 3 onwards is computed
    # the engine's blocks for it: every position in the full group; in the window group only those
    # the window of its first computed token (position 12) still reads: block 2 (tokens 8..11)
    slots = {"g0": [10, 11, 12, 13], "g1w4": [-1, -1, 12, 13]}
    for tag, cache in caches.items():
        seq = cache.allocate(more, slots=slots[tag])
        assert seq.num_cached_tokens == 12
        moves = engines[tag].step(cache)
        loaded = [b for kind, _, dst in moves if kind == L2_TO_L1 for b in dst]
        assert loaded == [b for b in slots[tag][:3] if b >= 0]
        assert same(engines[tag].blocks(loaded), {n: t[[slots[tag][:3].index(b) for b in loaded]]
                                                  for n, t in saved[tag].items()})
        cache.free(seq)
    for cache in caches.values():
        assert cache.flush(10)
        cache.close()
    alone = list(range(700, 700 + 3 * BS + 1))  # computed by the full group only
    with engine_cache(CacheConfig(l2=l2_bytes(8), l3=[url]), kv_format="g0") as full:
        Engine(full.l2).save(full, alone, [0, 1, 2, 3])
        assert full.flush(10)
    with engine_cache(CacheConfig(l2=l2_bytes(8), l3=[url]), kv_format="g1w4") as window:
        assert window.match(PROMPT).tokens == 12  # its own blocks, from L3
        assert window.match(alone).tokens == 0  # the full group's blocks are not its


# ---------------------------------------------------------------------------- misuse

def test_calls_the_engine_owned_mode_refuses_say_what_to_do():
    with engine_cache(CacheConfig(l2=l2_bytes(8))) as cache:
        with pytest.raises(UsageError, match=r"allocate\(\) on a cache whose L1 the engine owns needs slots="):
            cache.allocate(PROMPT)
        with pytest.raises(UsageError, match=r"got block id 16; the engine has blocks 0\.\.15"):
            cache.allocate(PROMPT, slots=[0, 1, 2, BLOCKS])
        with pytest.raises(UsageError, match=r"got block id -2; the engine has blocks 0\.\.15 \(-1: none kept\)"):
            cache.allocate(PROMPT, slots=[-2])
        for computed in (-4, len(PROMPT) + 1):  # the bound is the prompt's, not the blocks given so far
            with pytest.raises(UsageError, match=rf"allocate\(computed=\) takes .*, 0\.\.{len(PROMPT)}, got {computed}"):
                cache.allocate(PROMPT, slots=[0], computed=computed)
        assert not cache.live_sequences() and cache.take_moves()[1] == []  # nothing taken, nothing recorded
        seq = cache.allocate(PROMPT, slots=[0, 1])
        with pytest.raises(UsageError, match=r"append\(\) of 8 tokens needs 2 more block ids \(slots=\), got 0"):
            cache.append(seq, 8)
        with pytest.raises(UsageError, match=r"got block id 99"):
            cache.append(seq, 8, slots=[2, 99])
        assert seq.slots == [0, 1]
        # the whole-sequence API copies through tierkv's own L1, which this cache does not have
        for call in (lambda: cache.store(PROMPT, torch.zeros(LAYOUT.kv_shape(len(PROMPT)))),
                     lambda: cache.retrieve(PROMPT)):
            with pytest.raises(UsageError, match=r"engine_blocks=.*allocate"):
                call()
        cache.free(seq)

    with TieredKVCache(LAYOUT, CacheConfig(l1=l2_bytes(8), l2=l2_bytes(8)), device="cpu") as plain:
        with pytest.raises(UsageError, match=r"allocate\(slots=\) is for a cache whose L1 the engine owns"):
            plain.allocate(PROMPT, slots=[0, 1, 2, 3])
        assert not plain.live_sequences()
        seq = plain.allocate(PROMPT)
        with pytest.raises(UsageError, match=r"append\(slots=\) is for a cache whose L1 the engine owns"):
            plain.append(seq, 1, slots=[7])
        for call in (plain.take_moves, lambda: plain.moves_done(0)):
            with pytest.raises(UsageError, match=r"is for a cache made with engine_blocks="):
                call()
        plain.free(seq)


def test_engine_blocks_configurations_that_cannot_work_are_config_errors():
    buffers = [torch.zeros(BLOCKS, H, BS, 2 * D) for _ in range(LAYOUT.num_layers)]
    with pytest.raises(ConfigError, match="pass neither kv_caches nor CacheConfig.l1"):
        engine_cache(CacheConfig(l2=l2_bytes(8)), kv_caches=buffers, kv_layout="vllm_cpu")
    with pytest.raises(ConfigError, match="pass neither kv_caches nor CacheConfig.l1"):
        engine_cache(CacheConfig(l1=l2_bytes(8), l2=l2_bytes(8)))
    with pytest.raises(ConfigError, match="tierkv keeps L2 and L3: give CacheConfig.l2"):
        engine_cache(CacheConfig())
    with pytest.raises(ConfigError, match=r"engine_blocks must be the engine's number of KV blocks \(> 0\), got 0"):
        TieredKVCache(LAYOUT, CacheConfig(l2=l2_bytes(8)), engine_blocks=0)
    # the buffers were not claimed by the refused cache: an engine may register them
    DevicePool.of_buffers(LAYOUT, buffers, "vllm_cpu").release()


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    """docs/custom_engine.md's engine_blocks example, whose asserts check the hit and its bytes."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "custom_engine.md").read_text()
    code = doc.split("## Your block manager")[1].split("```python")[1].split("```")[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its L3 folder
    names: dict = {}
    exec(code, names)
    assert not os.path.exists(names["l2_file"])
    (l3,) = tmp_path.iterdir()  # write-through took the prompt's blocks to L3: another cache finds them
    with TieredKVCache(names["layout"], CacheConfig(l2="1MiB", l3=[f"file://{l3}"]), model="my-model@rev",
                       engine_blocks=8) as reader:
        assert reader.match(names["prompt"]).by_tier["l3"] == 96
