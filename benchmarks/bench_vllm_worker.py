"""bench_vllm_worker: TierKVConnector's worker side on the H200, driven as vLLM drives it.

vLLM does not fit on the H200 (its wheels are far over what a device call carries), so this
drives the connector's worker half (integrations/vllm/worker_side.py, which imports no vLLM)
through the calls vLLM makes each step: register_kv_caches once; then per step start_load_kv,
wait_for_layer_load before each layer's attention, wait_for_save after the forward. The
decider is the library in the connector's scheduler mode (TieredKVCache(engine_blocks=), L2 in a
/dev/shm file the worker maps and pins). The KV buffers have vLLM 0.32's CUDA shapes and strides:
per layer a view [N, H, B, 2D] of one backing buffer, in LBHNC (heads outer: what the connector
asks vLLM for) and LBNHC (FlashAttention's default), on a Llama-3.1-8B KV shape (32 layers, 8 KV
heads of 128, bf16, 16-token blocks: 2 MiB a block). Measured in the same run:
  save: wait_for_save of a step that filled `--blocks` blocks, until its copies are complete
        (the connector waits for them there), against one pinned device-to-host memcpy of the bytes;
  load: start_load_kv and a wait_for_layer_load per layer, until the loads are complete, against
        one pinned host-to-device memcpy;
  overlap: the load followed by a forward of 32 layers of matmuls (about as long, in all, as the
        load), each waiting for its layer in wait_for_layer_load: a timeline of the copy groups
        and the layers' compute (PNG), and whether each group's copy ran under the compute of the
        layers before it.
Targets (issue 38): saves and loads >= 90% of a pinned memcpy; layer l's load overlaps layer
l-1's compute. Writes benchmarks/results/bench_vllm_worker-<machine>.json and the timeline PNG.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench_custom_engine import memcpy_seconds
from common import RESULTS, write_results
from shapes import LLAMA_3_1_8B
from tierkv import CacheConfig, TieredKVCache
from tierkv.integrations.vllm.options import ConnectorOptions
from tierkv.integrations.vllm.records import StepWork
from tierkv.integrations.vllm.worker_side import WorkerSide

LAYOUT = LLAMA_3_1_8B
L, _, BS, H, D = LAYOUT.block_shape


def vllm_pages(order: str, blocks: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer KV views [N, H, B, 2D] of one backing buffer, in `order`."""
    if order == "LBNHC":
        backing = torch.empty(L, blocks, BS, H, 2 * D, dtype=LAYOUT.dtype, device="cuda")
        return {f"model.layers.{i}.self_attn.attn": backing[i].transpose(1, 2) for i in range(L)}
    backing = torch.empty(L, blocks, H, BS, 2 * D, dtype=LAYOUT.dtype, device="cuda")
    return {f"model.layers.{i}.self_attn.attn": backing[i] for i in range(L)}


class Harness:
    """The decider and one worker over `2 * blocks + 1` vLLM blocks (block 0 is vLLM's null block)."""

    def __init__(self, order: str, blocks: int) -> None:
        self.blocks = blocks
        self.shm = f"/dev/shm/tierkv-bench-{os.getpid()}-{order}"
        cache = CacheConfig(l2=(blocks + 1) * LAYOUT.bytes_per_block, l2_file=self.shm)
        opts = ConnectorOptions(cache=cache, model="bench", layout=LAYOUT, whole=LAYOUT, tp_size=1, kv_format="",
                                kv_layout="vllm_paged", engine_blocks=2 * blocks + 1)
        self.decider = TieredKVCache(LAYOUT, cache, model="bench", engine_blocks=2 * blocks + 1)
        self.pages = vllm_pages(order, 2 * blocks + 1)
        for t in self.pages.values():
            t.normal_()
        self.worker = WorkerSide([opts])  # one KV-cache group
        self.worker.register(self.pages)
        self.names = list(self.pages)
        self.round = 0

    def work(self) -> StepWork:
        batch, moves = self.decider.take_moves()
        return StepWork(batch=batch, moves=[moves])

    def save(self) -> tuple[float, list[int]]:
        """A step that computed a fresh prompt of `blocks` blocks: seconds of its wait_for_save."""
        self.decider.clear()
        self.round += 1
        tokens = [self.round * 1_000_000 + i for i in range(self.blocks * BS + 1)]
        seq = self.decider.allocate(tokens, slots=list(range(1, self.blocks + 2)), computed=len(tokens))
        self.decider.commit(seq, tokens)
        work = self.work()
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.worker.load(work)  # nothing to load: a step that only saves
        self.worker.save(work)
        seconds = time.perf_counter() - t
        self.decider.moves_done(self.worker.report().batch)
        self.decider.free(seq)
        return seconds, tokens

    def load(self, tokens: list[int], forward=None) -> tuple[float, object, torch.cuda.Event]:
        """A step that loads the prompt's blocks into other vLLM blocks: seconds from start_load_kv
        until every layer's loads are complete (each layer waited for in wait_for_layer_load,
        then `forward(layer)` if given)."""
        other = list(range(self.blocks + 1, 2 * self.blocks + 1)) + [0]
        seq = self.decider.allocate(tokens, slots=other)
        assert seq.num_cached_tokens == self.blocks * BS
        work = self.work()
        torch.cuda.synchronize()
        issued = torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        issued.record()
        self.worker.load(work)
        copies = self.worker.loads[0]  # the step's Transfer: an event per group of layers
        # when each group's copy ended: a timing event on a side stream that waits for the group's
        # event (tierkv's own events are made without timing, which costs them nothing)
        side, copies_end = torch.cuda.Stream(), []
        for e in copies.groups or [copies.event]:
            side.wait_event(e)
            copies_end.append(torch.cuda.Event(enable_timing=True))
            copies_end[-1].record(side)
        for i, name in enumerate(self.names):
            self.worker.wait_for_layer(name)
            if forward is not None:
                forward(i)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        self.worker.save(work)
        self.decider.moves_done(self.worker.report().batch)
        self.decider.free(seq)
        return seconds, (copies, copies_end), issued

    def check(self, tokens: list[int]) -> bool:
        """The loaded blocks equal the saved ones, K and V, in every layer."""
        first, other = list(range(1, self.blocks + 1)), list(range(self.blocks + 1, 2 * self.blocks + 1))
        return all(torch.equal(t[first], t[other]) for t in self.pages.values())

    def close(self) -> None:
        self.decider.close()
        self.worker.close()


def timeline(h: Harness, tokens: list[int], load_seconds: float, out_dir) -> dict:
    """The load under a forward of about as long: when each copy group ended, and each layer's compute."""
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    per_matmul = (time.perf_counter() - t) / 20
    per_layer = max(1, round(load_seconds / L / per_matmul))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(L)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(L)]

    def forward(i: int) -> None:
        starts[i].record()
        for _ in range(per_layer):
            a @ a
        ends[i].record()

    seconds, (loads, copies_end), issued = h.load(tokens, forward)  # (a staged DMA may have one event in all)
    # a staged load has an event per chunk of each group: a group's copy ends with its last
    copy_ms = [issued.elapsed_time(e) for e in copies_end]
    by_group: dict[int, float] = {}
    for first, end in zip(loads.starts or [0], copy_ms):
        by_group[first] = max(end, by_group.get(first, 0.0))
    group_first, group_end = list(by_group), list(by_group.values())
    compute = [(issued.elapsed_time(s), issued.elapsed_time(e)) for s, e in zip(starts, ends)]
    # group g's copy ran under compute when the layer before its first had started before it ended
    overlapped = [compute[group_first[g] - 1][0] < group_end[g] for g in range(1, len(group_end))]
    compute_ms = sum(e - s for s, e in compute)
    png = plot(group_first, group_end, compute, out_dir)
    return {"forward_ms": seconds * 1e3, "load_ms_alone": load_seconds * 1e3, "compute_ms": compute_ms,
            "serial_ms": load_seconds * 1e3 + compute_ms, "matmuls_per_layer": per_layer,
            "group_first_layer": group_first, "group_copy_end_ms": group_end,
            "layer_compute_ms": compute, "groups_overlapping_earlier_layers": overlapped, "png": png}


def plot(group_first, group_end, compute, out_dir) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 3))
    prev = 0.0
    for g, end in enumerate(group_end):
        ax.barh(1, end - prev, left=prev, color=f"C{g}", edgecolor="k")
        last = group_first[g + 1] - 1 if g + 1 < len(group_first) else len(compute) - 1
        ax.text((prev + end) / 2, 1, f"layers {group_first[g]}-{last}", ha="center", va="center", fontsize=8)
        prev = end
    for i, (s, e) in enumerate(compute):
        g = max(j for j, f in enumerate(group_first) if f <= i)
        ax.barh(0, e - s, left=s, color=f"C{g}", alpha=0.6)
    ax.set_yticks([0, 1], ["compute (layer)", "L2->L1 copy (group)"])
    ax.set_xlabel("ms since start_load_kv")
    ax.set_title("TierKVConnector worker on the H200: each layer waits only for its own group's copy")
    fig.tight_layout()
    path = os.path.join(out_dir or RESULTS, "bench_vllm_worker-timeline.png")
    fig.savefig(path, dpi=120)
    return os.path.basename(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1024, help="blocks a step saves or loads (2 MiB each)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_vllm_worker needs CUDA")
    nbytes = args.blocks * LAYOUT.bytes_per_block
    memcpy = memcpy_seconds(nbytes, args.repeats)
    results = {}
    for order in ("LBHNC", "LBNHC"):
        h = Harness(order, args.blocks)
        saves, loads = [], []
        for _ in range(args.repeats + 1):  # the first round warms up (Triton compiles the copies)
            seconds, tokens = h.save()
            saves.append(seconds)
            loads.append(h.load(tokens)[0])
        ok = h.check(tokens)
        row = {"save_s": min(saves[1:]), "load_s": min(loads[1:]), "bytes_checked": ok}
        row["save_ratio_to_memcpy"] = memcpy["d2h"] / row["save_s"]
        row["load_ratio_to_memcpy"] = memcpy["h2d"] / row["load_s"]
        row["save_GBps"], row["load_GBps"] = nbytes / row["save_s"] / 1e9, nbytes / row["load_s"] / 1e9
        if order == "LBHNC":
            row["overlap"] = timeline(h, tokens, row["load_s"], args.out)
        print(f"{order}: save {row['save_GBps']:.1f} GB/s ({row['save_ratio_to_memcpy']:.1%} of memcpy), "
              f"load {row['load_GBps']:.1f} GB/s ({row['load_ratio_to_memcpy']:.1%}), bytes checked {ok}")
        if "overlap" in row:
            o = row["overlap"]
            print(f"  forward with the load: {o['forward_ms']:.1f} ms; load alone {o['load_ms_alone']:.1f} ms + "
                  f"compute {o['compute_ms']:.1f} ms serial = {o['serial_ms']:.1f} ms; groups under earlier layers' "
                  f"compute: {o['groups_overlapping_earlier_layers']}")
        results[order] = row
        h.close()
    path = write_results("bench_vllm_worker", {
        "target": "saves and loads >= 90% of a pinned memcpy; layer l's load overlaps layer l-1's compute",
        "blocks": args.blocks, "bytes": nbytes, "memcpy_seconds": memcpy,
        "memcpy_GBps": {k: nbytes / v / 1e9 for k, v in memcpy.items()}, "results": results,
        "timing": "wall clock from the worker call (start_load_kv / wait_for_save) until the copies are complete "
                  "(a device sync), best of the repeats after a warm-up round; memcpy: one copy_ and a device sync",
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
