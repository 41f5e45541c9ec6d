"""benchmarks/bench_rounds.py end to end on a tiny random Llama: closed multi-round chat through two
real tierkv-serve processes (L1 only, L1+L2), whose L1 holds two of six histories, so the hit
rounds load from L2 in one and recompute in the other; each round's bound is built from the probes
and the bytes the server reports, and the profiled hit round leaves a trace."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_rounds  # noqa: E402


def test_hit_rounds_load_from_l2_and_are_read_against_their_bound(tmp_path):
    path = bench_rounds.main(["--smoke", "--profile-seconds", "0.3", "--step-log", "--out", str(tmp_path)])
    out = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    l1, l2 = out["configs"]["l1"], out["configs"]["l1+l2"]
    h2d = out["limits"]["h2d_bytes_per_s"]
    for config in (l1, l2):
        assert config["hit_rounds"]["errors"] == 0
        rounds = config["rounds"]
        assert len(rounds) == 3 and all(r["output_tokens"] == r["requests"] * 8 for r in rounds)
        assert rounds[0]["cached_tokens"] == 0  # round 0 is cold
        for r in rounds:
            b = r["bound"]
            assert b["seconds"]["pcie"] == pytest.approx((r["l2_bytes_out"] or 0) / h2d)
            assert b["bound_s"] == max(b["seconds"].values()) > 0
            assert b["bound_over_wall"] == pytest.approx(b["bound_s"] / r["wall_s"])
            # whole requests per seat: 6 requests on 2 seats, 3 each, 7 decode steps a request
            cold, step = config["cold_probe"]["s_per_token"], config["batch_probe"]["step_s"]
            expected = b["computed_tokens"] * cold + 3 * 7 * step + (r["l2_bytes_out"] or 0) / 6 / h2d
            assert b["whole_requests_s"] == pytest.approx(expected) and b["whole_requests_s"] >= b["seconds"]["compute"]
            # a step serves at most the two histories L1 holds: 6 requests x 7 decoded tokens / 2
            assert b["at_once"] == 2 and b["decode_steps"] == math.ceil(6 * 7 / 2)
            # the engine's own count, over the round alone: its steps hold at most the two requests L1
            # holds (three of these prompts need more blocks than it has), so the 6 x 7 decoded tokens
            # took at least the bound's steps (mixed ones decode others' tokens too). Round 0's counts
            # once took in the last steps before it (the warm-up's batch of eight short requests): the
            # counters are read only once the server's snapshot has caught up
            e = r["engine"]
            assert sum(e["steps"].values()) >= b["decode_steps"] and e["steps"]["mixed"] >= 1, e
            assert 1 <= e["mean_batch"] <= 2 and e["idle_s"] >= 0 and e["host_s"]["launch"] > 0, e
            assert max(int(size) for sizes in e["batches"].values() for size in sizes) <= b["at_once"], e
            # every token of the round came from a step of its request (a prompt's chunks take more)
            assert sum(int(size) * n for sizes in e["batches"].values() for size, n in sizes.items()) >= \
                r["output_tokens"], e
            # the steps by batch size (each size up to 8 its own bucket): they add up to the steps of
            # each kind and to the requests in them
            assert {kind: sum(sizes.values()) for kind, sizes in e["batches"].items()} == e["steps"], e
            requests = sum(int(size) * n for sizes in e["batches"].values() for size, n in sizes.items())
            assert requests == pytest.approx(e["mean_batch"] * sum(e["steps"].values())), e
            # every request's first token and end, from the round's start, and the seats they kept busy
            assert len(r["first_token_s"]) == len(r["done_s"]) == r["requests"]
            assert all(0 < s < d <= r["wall_s"] for s, d in zip(r["first_token_s"], r["done_s"]))
            st = r["seats"]
            assert st["seats"] == 2 and 0 < st["full_s"] < r["wall_s"] and 0 < st["decoding_share"] <= 1, st
    # L1 only: the six histories rotate through room for two, so every hit round recomputes them
    assert all(r["l2_bytes_out"] == 0 and r["cached_tokens"] == 0 for r in l1["rounds"])
    # with L2 the histories come back over the copy: most of each hit round's prompt is cached
    for r in l2["rounds"][1:]:
        assert r["l2_bytes_out"] > 0 and r["cached_tokens"] > 0.8 * r["prompt_tokens"], r
        assert r["bound"]["computed_tokens"] < l1["rounds"][1]["bound"]["computed_tokens"] / 4
    assert out["hit_rounds_l1_over_l1_l2"] > 0 and "meets_target" in out
    # the second hit round (round 2) was traced on each server, and is left out of the hit rounds' sums
    for config in (l1, l2):
        assert config["hit_rounds"]["wall_s"] == config["rounds"][1]["wall_s"]
        assert config["hit_rounds"]["whole_requests_s"] == config["rounds"][1]["bound"]["whole_requests_s"]
    for name in ("l1", "l1+l2"):
        prof = out["configs"][name]["rounds"][2]["profile"]
        assert "error" not in prof, prof
        assert (tmp_path / prof["trace"]).stat().st_size > 0 and prof["summary"]["window_ms"] > 0
        # each server's step log: every request it was sent (probes, warm-up, 3 rounds of 6) added and
        # admitted once, and each round's requests added after the round's start, on the log's clock
        [steps] = tmp_path.glob(f"bench_rounds-{name.replace('+', '_')}-*-steps.jsonl")
        lines = [json.loads(line) for line in steps.read_text().splitlines()]
        added = [x for x in lines if x["ev"] == "add"]
        assert len(added) >= 18 and sorted(i for x in lines if x["ev"] == "step" for i in x["admitted"]) == \
            sorted(x["id"] for x in added)
        for r in out["configs"][name]["rounds"]:
            assert sum(r["start_clock"] <= x["t"] <= r["start_clock"] + r["wall_s"] for x in added) == r["requests"]


def test_a_freed_seat_is_timed_to_the_first_token_of_the_request_that_takes_it():
    # two seats, five requests: a and b start together; c takes the seat a frees at 1.0 (its first
    # token at 1.3), d the one b frees at 1.2 (at 1.4), e the one c frees at 2.0 (at 2.6)
    first = [0.1, 0.2, 1.3, 1.4, 2.6]
    done = [1.0, 1.2, 2.0, 2.5, 3.0]
    st = bench_rounds.seat_turnovers(first, done, seats=2, wall_s=3.0)
    assert st["full_s"] == 0.2
    assert st["turnover_mean_s"] == pytest.approx((0.3 + 0.2 + 0.6) / 3)
    assert st["turnover_p50_s"] == pytest.approx(0.3)
    assert st["decoding_share"] == pytest.approx((0.9 + 1.0 + 0.7 + 1.1 + 0.4) / (2 * 3.0))
    # the order the requests finish in is not the order they started in: the pairing is by time
    shuffled = bench_rounds.seat_turnovers(first[::-1], done[::-1], seats=2, wall_s=3.0)
    assert shuffled == pytest.approx(st)
    assert bench_rounds.seat_turnovers(first[:2], done[:2], seats=2, wall_s=3.0) is None


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs the py-spy binary (pip install py-spy)")
def test_the_last_round_sampled_by_py_spy_is_summarised_and_left_out(tmp_path):
    path = bench_rounds.main(["--smoke", "--configs", "l1+l2", "--py-spy", "gil", "--out", str(tmp_path)])
    out = json.loads(path.read_text())
    config = out["configs"]["l1+l2"]
    last = config["rounds"][-1]
    assert last["py_spy"]["mode"] == "gil", last.get("py_spy")
    text = (tmp_path / "profiles" / last["py_spy"]["summary"]).read_text()
    assert "== thread" in text and "samples" in text
    assert "step (" in text  # the engine's step() held the GIL in some samples
    # the sampled round is left out of the hit rounds' sums: only round 1 is in them
    assert config["hit_rounds"]["wall_s"] == config["rounds"][1]["wall_s"]


@pytest.mark.parametrize("argv, message", [
    (["--profile-round", "0"], "must name a hit round, 1 to 2"),
    (["--profile-round", "3"], "must name a hit round, 1 to 2"),
])
def test_the_profiled_round_must_be_a_hit_round(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_rounds.parse(["--smoke", "--rounds", "3", "--profile-seconds", "1", *argv])
    assert message in capsys.readouterr().err
    a = bench_rounds.parse(["--smoke", "--rounds", "3", "--profile-seconds", "1", "--profile-round", "1"])
    assert a.profile_round == 1
