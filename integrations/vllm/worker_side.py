"""A worker's half of the connector: the copies. It maps the scheduler's shared L2 and vLLM's
registered KV tensors (one per layer, in vLLM's page layout), and runs each step's recorded
copies on them: loads before the forward that reads them, saves after the forward that writes
them. Then it reports the batch done (CopiesDone).

Runs in each vLLM worker process. Decides nothing: every slot comes in StepWork.
"""

from __future__ import annotations

import logging

import torch

from tierkv.layout import stored_layout
from tierkv.tiers import DevicePool, HostPool
from tierkv.recorded_moves import L1_TO_L2, L2_TO_L1, run_moves
from tierkv.transfer import DONE, BlockMover, Transfer

from . import options
from .records import CopiesDone, StepWork

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, opts: options.ConnectorOptions) -> None:
        self.options = opts
        self.tp_rank = 0
        self.l1: DevicePool | None = None
        self.mover: BlockMover | None = None  # made at the first copy: the scheduler makes L2 after registration
        self.done = -1  # the last batch run here
        self.loads: Transfer = DONE  # the step's loads in flight

    def register(self, kv_caches: dict[str, torch.Tensor], tp_rank: int = 0) -> None:
        """register_kv_caches: vLLM's per-layer tensors, in layer order, checked against the layout;
        `tp_rank`: this worker's tensor-parallel rank (its KV heads' place in a whole block)."""
        self.tp_rank = tp_rank
        self.l1 = DevicePool.of_buffers(self.options.layout, kv_caches, self.options.kv_layout)
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}

    def _mover(self) -> BlockMover:
        if self.mover is None:
            opts = self.options
            h = opts.layout.num_kv_heads  # this rank's KV heads of each whole-model L2 block
            heads = (self.tp_rank * h, (self.tp_rank + 1) * h) if opts.tp_size > 1 else None
            l2 = HostPool.attach(stored_layout(opts.whole, opts.cache.kv_offload_dtype), opts.cache.l2_file, heads=heads)
            # no warm-up copy through slot 0: the scheduler may have filled it already
            self.mover = BlockMover(self.l1, l2, warm_up=False)
        return self.mover

    def load(self, work: StepWork | None) -> None:
        """start_load_kv: start the step's loads (on a GPU, on the copy stream, in groups of layers)."""
        if work is None or not any(kind == L2_TO_L1 for kind, _, _ in work.moves):
            return
        self.loads = run_moves(self._mover(), work.moves, kinds=(L2_TO_L1,))

    def wait_for_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: the forward's stream waits for this layer's loads alone (no host
        sync), so the first layers compute while later ones still load."""
        self.loads.wait_layer(self.layer_index[layer_name])

    def save(self, work: StepWork | None) -> None:
        """wait_for_save: run the step's saves (after the forward wrote their blocks) and wait for
        every copy of the batch, so that vLLM may reuse the blocks once the step ends."""
        if work is None or work.batch < 0:
            return
        self._mover()  # mapped by the first report at the latest: the scheduler then unlinks the file
        self.loads.wait()  # a layer the forward did not wait for (no attention ran in it)
        if any(kind == L1_TO_L2 for kind, _, _ in work.moves):
            run_moves(self._mover(), work.moves, kinds=(L1_TO_L2,)).synchronize()
        self.loads.synchronize()
        self.loads = DONE
        self.done = work.batch

    def report(self) -> CopiesDone:
        return CopiesDone(self.done)

    def close(self) -> None:
        if self.l1 is not None:
            self.l1.release()
