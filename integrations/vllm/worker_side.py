"""A worker's half of the connector: the copies. It maps the scheduler's shared L2 and vLLM's
registered KV tensors (one per layer, in vLLM's page layout), and runs each step's recorded
copies on them: loads before the forward that reads them, saves after the forward that writes
them. Then it reports the batch done (CopiesDone). Under vLLM's hybrid KV-cache manager each
KV-cache group has its layers, its L2 and its copies (options.per_group).

Runs in each vLLM worker process. Decides nothing: every slot comes in StepWork.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tierkv.layout import stored_layout
from tierkv.tiers import DevicePool, HostPool
from tierkv.recorded_moves import L1_TO_L2, L2_TO_L1, run_moves
from tierkv.transfer import DONE, BlockMover, Transfer

from . import options
from .records import CopiesDone, StepWork

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, groups: list[options.ConnectorOptions]) -> None:
        """`groups`: each KV-cache group's options (one, without vLLM's hybrid manager)."""
        self.groups = groups
        self.tp_rank = 0
        self.l1: list[DevicePool] = []  # each group's layers
        self.claim: DevicePool | None = None  # every layer, where the groups share their buffers
        self.movers: list[BlockMover | None] = [None] * len(groups)  # made at the first copy: the
        # scheduler makes L2 after registration
        self.layer_index: dict[str, tuple[int, int]] = {}  # layer name -> (group, its layer there)
        self.done = -1  # the last batch run here
        self.loads: list[Transfer] = [DONE] * len(groups)  # each group's loads in flight this step

    def register(self, kv_caches: dict[str, torch.Tensor], tp_rank: int = 0) -> None:
        """register_kv_caches: vLLM's per-layer tensors, in layer order, checked against the layout;
        `tp_rank`: this worker's tensor-parallel rank (its KV heads' place in a whole block)."""
        self.tp_rank = tp_rank
        grouped = len(self.groups) > 1
        if grouped:  # the groups' layers are views of shared buffers, whose blocks one allocator hands
            # out: one claim over every layer, so that no other cache takes that memory as its L1
            first = self.groups[0]
            self.claim = DevicePool.of_buffers(replace(first.layout, num_layers=len(kv_caches)), kv_caches,
                                               first.kv_layout)
        for g, opts in enumerate(self.groups):
            names = opts.layer_names or tuple(kv_caches)
            self.l1.append(DevicePool.of_buffers(opts.layout, {n: kv_caches[n] for n in names}, opts.kv_layout,
                                                 claim=not grouped))
            self.layer_index.update((name, (g, i)) for i, name in enumerate(names))

    def _mover(self, g: int) -> BlockMover:
        if self.movers[g] is None:
            opts = self.groups[g]
            h = opts.layout.num_kv_heads  # this rank's KV heads of each whole-model L2 block
            heads = (self.tp_rank * h, (self.tp_rank + 1) * h) if opts.tp_size > 1 else None
            l2 = HostPool.attach(stored_layout(opts.whole, opts.cache.kv_offload_dtype), opts.cache.l2_file, heads=heads)
            # no warm-up copy through slot 0: the scheduler may have filled it already
            self.movers[g] = BlockMover(self.l1[g], l2, warm_up=False)
        return self.movers[g]

    def load(self, work: StepWork | None) -> None:
        """start_load_kv: start the step's loads (on a GPU, on the copy stream, in groups of layers)."""
        if work is None:
            return
        for g, moves in enumerate(work.moves):
            if any(kind == L2_TO_L1 for kind, _, _ in moves):
                self.loads[g] = run_moves(self._mover(g), moves, kinds=(L2_TO_L1,))

    def wait_for_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: the forward's stream waits for this layer's loads alone (no host
        sync), so the first layers compute while later ones still load."""
        g, i = self.layer_index[layer_name]
        self.loads[g].wait_layer(i)

    def save(self, work: StepWork | None) -> None:
        """wait_for_save: run the step's saves (after the forward wrote their blocks) and wait for
        every copy of the batch, so that vLLM may reuse the blocks once the step ends."""
        if work is None or work.batch < 0:
            return
        for g in range(len(self.groups)):
            moves = work.moves[g] if g < len(work.moves) else []
            self._mover(g)  # mapped by the first report at the latest: the scheduler then unlinks the file
            self.loads[g].wait()  # a layer the forward did not wait for (no attention ran in it)
            if any(kind == L1_TO_L2 for kind, _, _ in moves):
                run_moves(self._mover(g), moves, kinds=(L1_TO_L2,)).synchronize()
            self.loads[g].synchronize()
            self.loads[g] = DONE
        self.done = work.batch

    def report(self) -> CopiesDone:
        return CopiesDone(self.done)

    def close(self) -> None:
        for l1 in [*self.l1, self.claim]:
            if l1 is not None:
                l1.release()
