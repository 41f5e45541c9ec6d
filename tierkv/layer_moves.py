"""LayerMoves: the moves of a running sequence's KV that a step overlaps with its forward.

`wait_for_layer` orders a layer's attention after the L2 loads of that layer only, so the first
layers compute while the later ones still load; `save_layer` copies each group of written layers
to L2 while the rest of the forward runs (write-through). A sequence larger than L1 moves its
oldest blocks to L2 (`offload`) and reads them back layer by layer (`stream`, streaming.py).
On top of PagedCache (paged.py), whose checks and block bookkeeping these calls share; mixed
into TieredKVCache. Which blocks are evicted or copied down is decided in tiering.py and bytes
move in transfer.py; this file never knows about requests, scheduling or HTTP.
"""

from __future__ import annotations

import torch

from .errors import UsageError
from .guard import guarded
from .index import BlockEntry
from .paged import PagedCache
from .sequence import LayerSave, SequenceBlocks
from .streaming import LayerStream, StreamPlan
from .transfer import DONE, layer_groups


class LayerMoves(PagedCache):
    """The per-layer hooks of a step and the calls of sequences larger than L1."""

    # ------------------------------------------------------------------ sequences larger than L1

    @guarded
    def offload(self, seq: SequenceBlocks, num_blocks: int) -> int:
        """Move the oldest `num_blocks` L1 blocks of `seq` to L2, freeing their L1 room.

        The blocks must hold computed KV (full blocks before the sequence's next token). Shared
        blocks stay indexed (now unpinned in L1, held in L2); private ones move to a private L2
        slot. Returns how many moved: fewer when L2 has no room left.
        """
        self._refuse_engine_blocks("offload")
        self._check_seq(seq, "offload")
        if self.l2 is None or num_blocks <= 0 or seq.released:  # (its first blocks are gone: no prefix to move)
            return 0
        first = seq.offloaded
        todo = range(first, min(first + num_blocks, len(seq.slots)))
        self.tiers.write_down([e for i in todo if (e := seq.entries[i]) is not None])
        private = [i for i in todo if seq.entries[i] is None]
        private_l2 = dict(zip(private, self.tiers.take_l2(len(private))))
        # Offloaded blocks stay a prefix: stop at the first block that found no room in L2.
        n = next((j for j, i in enumerate(todo) if not self._has_l2_copy(seq.entries[i], i in private_l2)), len(todo))
        moved = todo[:n]
        self.tiers.give_l2([slot for i, slot in private_l2.items() if i not in moved])
        copies = [(seq.slots[i], private_l2[i]) for i in moved if seq.entries[i] is None]
        if copies:
            self.tiers.copy_down([a for a, _ in copies], [b for _, b in copies])
            self.tiers.count("l2", len(copies), into=True)
        for i in moved:
            e = seq.entries[i]
            if e is None:
                seq.l2_slots.append(private_l2[i])
            else:
                self.index.hold_l2([e])
                self.index.unpin(e)
                seq.l2_slots.append(e.l2)
        self._give_private([seq.slots[i] for i in moved if seq.entries[i] is None])
        if copies:
            self.tiers.fence()  # the freed L1 slots are reused only after the copies out of them
        for i in moved:
            seq.slots[i] = -1
        return n

    @staticmethod
    def _has_l2_copy(entry: BlockEntry | None, private_slot: bool) -> bool:
        return private_slot if entry is None else entry.l2 >= 0

    @guarded
    def stream(self, seqs: list[SequenceBlocks]) -> LayerStream:
        """Start assembling the KV of `seqs` (streamed sequences) layer by layer for one step.

        Returns the step's LayerStream: its `plan.block_tables` [len(seqs), width] index the
        staging buffer that `layer_kv(layer, pool)` fills (see streaming.py).
        """
        for seq in seqs:
            self._check_seq(seq, "stream")
        plan = StreamPlan.build(seqs, self.device)
        self.tiers.count("l2", plan.l2_blocks, into=False)
        mover = self.tiers.mover
        return self.streamer.start(plan, mover.last if mover is not None else DONE)

    # ------------------------------------------------------------------ per-layer hooks

    @guarded
    def wait_for_layer(self, layer: int, seqs: list[SequenceBlocks]) -> None:
        """Order the current stream after the L2 loads of layer `layer` of `seqs`' blocks, and no
        more (no host sync): call it before that layer's attention, in place of `seq.wait()`, so
        that the first layers compute while the later ones still load. Loads go in
        LAYER_GROUPS groups of layers (transfer.py), so waiting for layer 0 waits for its group."""
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"wait_for_layer() takes a layer in 0..{self.layout.num_layers - 1}, got {layer}")
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for seq in seqs:
            self._check_seq(seq, "wait_for_layer")
            for load in seq.pending:
                load.wait_layer(layer, stream)

    @guarded
    def save_layer(self, layer: int, seqs: list[SequenceBlocks]) -> None:
        """Layer `layer` of the blocks this step fills is written: copy it to L2 while the rest of
        the forward runs (call it after that layer's K/V write, layers in order from 0). Layers
        go down in LAYER_GROUPS groups (transfer.py), each once its last layer is written: one
        layer of a block alone is too narrow a piece for a DMA. `commit` then enters the blocks
        in L1 and L2 (and, write-through, L3) without another copy, after copying the layers
        not saved yet. The step's full blocks are those up to the room `append` made
        (`seq.num_tokens`; `admit` makes room for the whole prompt): `commit`, which the engine
        calls after every forward (even one that filled no block), keeps the copies of the blocks
        it enters and drops the others. Only write-through copies down at commit:
        under write-back and selective, blocks go down later, and this does nothing; nor does it
        when L2 holds another format (fp8), whose blocks are converted whole at commit."""
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"save_layer() takes a layer in 0..{self.layout.num_layers - 1}, got {layer}")
        for seq in seqs:
            self._check_seq(seq, "save_layer")
        if self.l2 is None or self.config.write_policy != "write_through" or self.tiers.mover.l2_planes is None:
            return
        for seq in seqs:  # every check before anything changes
            save = seq.saving
            if save is not None and save.layers == self.layout.num_layers:  # commit ends a step's save
                raise UsageError("save_layer() of a sequence whose last forward was saved but not committed: call "
                                 "commit(seq, tokens) after each forward, with the tokens whose KV is written, "
                                 "even when no block filled")
            if save is not None and save.layers != layer:
                raise UsageError(f"save_layer() takes the layers in order from 0: this sequence's next is "
                                 f"{save.layers}, got {layer}")
        saves: list[tuple[SequenceBlocks, LayerSave]] = []
        for seq in seqs:
            save = seq.saving
            if save is None and layer == 0:
                bs = self.block_size
                blocks = [i for i in range(seq.committed, seq.num_tokens // bs) if seq.slots[i] >= 0]
                slots = self.tiers.take_l2(len(blocks))  # fewer when L2 is full: the rest go down at commit
                save = seq.saving = LayerSave(blocks[: len(slots)], slots) if slots else None
            if save is not None:
                saves.append((seq, save))
        for _, save in saves:
            save.layers = layer + 1
        if not saves or layer + 1 not in (*layer_groups(self.layout.num_layers)[1:], self.layout.num_layers):
            return
        # the group is written: copy it, one move for the saves that copied as far before
        by_start: dict[int, list[tuple[SequenceBlocks, LayerSave]]] = {}
        for seq, save in saves:
            by_start.setdefault(save.copied, []).append((seq, save))
        for start, group in by_start.items():
            l1_slots = [seq.slots[i] for seq, save in group for i in save.blocks]
            l2_slots = [slot for _, save in group for slot in save.l2_slots]
            moved = self.tiers.save_layers(l1_slots, l2_slots, range(start, layer + 1))
            for _, save in group:
                save.copied, save.moved = layer + 1, moved
