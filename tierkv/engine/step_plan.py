"""StepPlan: what rank 0 tells the other tensor-parallel ranks about one step, and its wire format.

Rank 0 schedules and decides everything. Another rank only repeats rank 0's byte moves between
its own L1 and L2 (the same slots, holding its own KV heads) and runs the same forward pass
over the same flat batch. A StepPlan carries exactly that:
- the L1/L2 moves rank 0 made since the last plan (`Tiering.moves`), in order, with the points
  where an L3 read's blocks must have landed in L2 (`L3_LANDED`);
- the step's host input arrays (`StepInputs`): positions, slots, block tables, lengths;
- the blocks of the streamed sequences, so that the rank streams its own L2 copies of them.

It travels as one int64 array: no pickle, so a rank never unpickles what another sends. This
file never runs a model, touches a cache or talks to a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# what a plan asks of the other ranks; MOVES: repeat the moves, no forward (sent when an L3 job
# needs the other ranks to have made them: engine/head_exchange.py)
STEP, STATS, STOP, MOVES = 0, 1, 2, 3

# The host arrays of a step, in wire order (StepInputs fills them; see inputs.py for shapes).
ARRAYS = ("positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "logits_indices")

Move = tuple[int, list[int], list[int]]  # (Tiering move kind, source slots, destination slots)


@dataclass(slots=True)
class StepPlan:
    kind: int = STEP
    moves: list[Move] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # ARRAYS -> 1-D int arrays
    width: int = 0  # columns of the block table (arrays["block_tables"] is [B * width])
    is_decode: bool = False
    context: int | None = None  # AttentionMetadata.context
    streamed_from: int | None = None  # the first streamed sequence (they are the batch's last)
    streamed: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (L1 slots, L2 slots) each

    def encode(self) -> np.ndarray:
        """The plan as one int64 array: a header of scalars, then length-prefixed sections."""
        parts: list[np.ndarray] = [np.array([
            self.kind, int(self.is_decode), -1 if self.context is None else self.context, self.width,
            -1 if self.streamed_from is None else self.streamed_from, len(self.moves), len(self.streamed),
            int(bool(self.arrays)),
        ], dtype=np.int64)]

        def section(values) -> None:
            values = np.asarray(values, dtype=np.int64)
            parts.extend((np.array([values.size], dtype=np.int64), values.ravel()))

        for kind, src, dst in self.moves:
            parts.append(np.array([kind], dtype=np.int64))
            section(src)
            section(dst)
        if self.arrays:
            for name in ARRAYS:
                section(self.arrays[name])
        for slots, l2_slots in self.streamed:
            section(slots)
            section(l2_slots)
        return np.concatenate(parts)

    @classmethod
    def decode(cls, data: np.ndarray) -> StepPlan:
        """The inverse of `encode`."""
        kind, is_decode, context, width, streamed_from, n_moves, n_streamed, has_arrays = (int(v) for v in data[:8])
        at = 8

        def section() -> np.ndarray:
            nonlocal at
            n = int(data[at])
            out = data[at + 1 : at + 1 + n]
            at += 1 + n
            return out

        def scalar() -> int:
            nonlocal at
            at += 1
            return int(data[at - 1])

        moves = [(scalar(), section().tolist(), section().tolist()) for _ in range(n_moves)]
        arrays = {name: section() for name in ARRAYS} if has_arrays else {}
        streamed = [(section().tolist(), section().tolist()) for _ in range(n_streamed)]
        if at != len(data):
            raise ValueError(f"a step plan of {len(data)} values has {len(data) - at} left over")
        return cls(kind, moves, arrays, width, bool(is_decode), None if context < 0 else context,
                   None if streamed_from < 0 else streamed_from, streamed)
