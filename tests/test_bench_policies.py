"""benchmarks/bench_policies.py on hand-made traces: ceiling, Belady and LRU figures worked out by
hand, the multi-tier replay (L2 in the cache, L3 in the ledger), and the script end to end."""

import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_policies import Request, ceiling, load_trace, main, next_uses, replay  # noqa: E402

BS = 4  # tokens a block in these traces


def cyclic() -> list[Request]:
    """a, b, c, a, b, c: each request one full block (the hittable one) and a private 1-token tail."""
    return [Request(5, [x, 100 + t]) for t, x in enumerate([1, 2, 3, 1, 2, 3])]


def rate(result: dict) -> Fraction:
    return Fraction(sum(result["hit_tokens"].values()), result["total_tokens"])


def test_ceiling_by_hand():
    trace = [
        Request(9, [1, 2, 3]),  # blocks 1, 2 full, 3 is one token: never cached
        Request(9, [1, 2, 4]),  # hits 1, 2: 8 tokens
        Request(13, [5, 6, 7, 8]),  # new
        Request(9, [1, 2, 9]),  # hits 1, 2: 8
        Request(13, [5, 6, 7, 10]),  # 3 usable blocks (the last token is computed), all hit: 12
        Request(9, [1, 4, 3]),  # 4 came after a different parent before (2): only 1 hits: 4
    ]
    expected = Fraction(8 + 8 + 12 + 4, 9 + 9 + 13 + 9 + 13 + 9)
    assert Fraction(ceiling(trace, BS)).limit_denominator(1000) == expected
    inf = replay(trace, "lru", 1000, block_size=BS)  # the cache with room for everything agrees
    assert rate(inf) == expected and inf["hit_tokens"]["l1"] == 32


def test_next_uses():
    assert next_uses(cyclic())[0] == [3, float("inf")]
    assert next_uses(cyclic())[3] == [float("inf"), float("inf")]


def test_belady_and_lru_on_a_cycle_one_block_larger_than_the_cache():
    # L1 of 3 blocks: a running request takes 2 (its block + its tail), so 2 blocks stay cached.
    # LRU always evicts exactly the block needed next: no hit. MIN keeps a then c: hits at t=3, 5.
    trace = cyclic()
    total = 6 * 5
    assert rate(replay(trace, "lru", 3, block_size=BS)) == 0
    assert rate(replay(trace, "belady", 3, block_size=BS)) == Fraction(8, total)
    assert Fraction(ceiling(trace, BS)).limit_denominator(100) == Fraction(12, total)
    for policy in ("lfu", "s3fifo", "arc", "priority"):
        assert rate(replay(trace, policy, 3, block_size=BS)) <= Fraction(8, total)


def test_belady_drops_the_chain_tail_among_equal_next_uses():
    trace = [Request(13, [1, 2, 3, 50]), Request(5, [7, 51]), Request(13, [1, 2, 3, 52])]
    # room for 1, 2, 3 and 7 between requests: r2 hits its 3 usable blocks
    assert rate(replay(trace, "belady", 5, block_size=BS)) == Fraction(12, 31)
    # one block less: r1 must evict one of 1, 2, 3 (all next used by r2). Dropping the tail 3
    # keeps 8 tokens; dropping the head 1 would strand 2 and 3 and keep none.
    assert rate(replay(trace, "belady", 4, block_size=BS)) == Fraction(8, 31)


def test_multi_tier_serves_from_l2_and_l3():
    trace = cyclic()
    # L1 keeps one block between requests, L2 (write-through) all three: every reuse is an L2 hit
    r = replay(trace, "lru", 2, 3, block_size=BS)
    assert r["hit_tokens"] == {"l1": 0, "l2": 12, "l3": 0}
    # no L2, an L3 of 3 blocks in the ledger: every reuse comes from L3, after the L1 walk misses
    r = replay(trace, "lru", 2, 0, 3, block_size=BS)
    assert r["hit_tokens"] == {"l1": 0, "l2": 0, "l3": 12}
    # an L3 too small for the cycle behaves like LRU: nothing
    assert replay(trace, "lru", 2, 0, 2, block_size=BS)["hit_tokens"]["l3"] == 0


def test_script_runs_on_a_tiny_trace(tmp_path):
    lines = [json.dumps({"timestamp": t, "input_length": 1200 + 100 * (t % 3), "output_length": 10,
                         "hash_ids": [0, 1 + t % 4, 10 + t % 5]}) for t in range(40)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(load_trace(path)) == 40
    fig = main(["--trace", str(path), "--capacities", "4,8", "--tiers", "1024,2048,4096", "--workers", "1",
                "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("bench_policies-*.json")).read_text())
    assert saved["hit_rate"] == fig["hit_rate"] and "git_commit" in saved["environment"]
    assert next(tmp_path.glob("bench_policies-*.png")).stat().st_size > 0
    assert saved["ceiling"] == pytest.approx(saved["ceiling_via_cache"])
    for p, rates in saved["hit_rate"].items():
        for c, v in rates.items():
            assert v <= saved["hit_rate"]["belady"][c] + 1e-12, (p, c)
            assert v <= saved["ceiling"] + 1e-12
