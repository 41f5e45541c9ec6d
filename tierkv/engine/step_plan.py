"""StepPlan: what rank 0 tells the other tensor-parallel ranks about one step, and its wire format.

Rank 0 schedules and decides everything. Another rank only repeats rank 0's byte moves between
its own L1 and L2 (the same slots, holding its own KV heads) and runs the same forward pass
over the same flat batch. A StepPlan carries exactly that:
- the L1/L2 moves rank 0 made since the last plan (`Tiering.moves`), in order, with the points
  where an L3 read's blocks must have landed in L2 (`L3_LANDED`): a list for each cache (one
  per layer group of a model with sliding windows, groups.py; else one), whose slots are its own;
- the step's host input arrays (`StepInputs`): positions, slots, block tables, lengths, and each
  further layer group's slots and block tables;
- the blocks of the streamed sequences, so that the rank streams its own L2 copies of them (only
  the first cache streams).

It travels as one int64 array: no pickle, so a rank never unpickles what another sends. This
file never runs a model, touches a cache or talks to a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# what a plan asks of the other ranks; MOVES: repeat the moves, no forward (sent when an L3 job
# needs the other ranks to have made them: engine/head_exchange.py)
STEP, STATS, STOP, MOVES = 0, 1, 2, 3

# The host arrays of a step, in wire order (StepInputs fills them; see inputs.py for shapes), and
# those that layer group g > 0 has of its own, named "<name>:g".
ARRAYS = ("positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "logits_indices")
GROUP_ARRAYS = ("slot_mapping", "block_tables")

Move = tuple[int, list[int], list[int]]  # (Tiering move kind, source slots, destination slots)


@dataclass(slots=True)
class StepPlan:
    kind: int = STEP
    moves: list[list[Move]] = field(default_factory=list)  # each cache's, in cache order
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # ARRAYS (and group ones) -> 1-D int arrays
    width: int = 0  # columns of the block table (arrays["block_tables"] is [B * width])
    is_decode: bool = False
    context: int | None = None  # AttentionMetadata.context
    streamed_from: int | None = None  # the first streamed sequence (they are the batch's last)
    streamed: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (L1 slots, L2 slots) each

    def encode(self) -> np.ndarray:
        """The plan as one int64 array: a header of scalars, then length-prefixed sections."""
        groups = self.array_groups()
        parts: list[np.ndarray] = [np.array([
            self.kind, int(self.is_decode), -1 if self.context is None else self.context, self.width,
            -1 if self.streamed_from is None else self.streamed_from, len(self.moves), len(self.streamed), groups,
        ], dtype=np.int64)]

        def section(values) -> None:
            values = np.asarray(values, dtype=np.int64)
            parts.extend((np.array([values.size], dtype=np.int64), values.ravel()))

        for moves in self.moves:
            parts.append(np.array([len(moves)], dtype=np.int64))
            for kind, src, dst in moves:
                parts.append(np.array([kind], dtype=np.int64))
                section(src)
                section(dst)
        for name in array_names(groups):
            section(self.arrays[name])
        for slots, l2_slots in self.streamed:
            section(slots)
            section(l2_slots)
        return np.concatenate(parts)

    @classmethod
    def decode(cls, data: np.ndarray) -> StepPlan:
        """The inverse of `encode`."""
        kind, is_decode, context, width, streamed_from, n_caches, n_streamed, groups = (int(v) for v in data[:8])
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

        moves = [[(scalar(), section().tolist(), section().tolist()) for _ in range(scalar())] for _ in range(n_caches)]
        arrays = {name: section() for name in array_names(groups)}
        streamed = [(section().tolist(), section().tolist()) for _ in range(n_streamed)]
        if at != len(data):
            raise ValueError(f"a step plan of {len(data)} values has {len(data) - at} left over")
        return cls(kind, moves, arrays, width, bool(is_decode), None if context < 0 else context,
                   None if streamed_from < 0 else streamed_from, streamed)

    def array_groups(self) -> int:
        """How many layer groups the arrays are of: 0 without arrays, else 1 + those named ":g"."""
        if not self.arrays:
            return 0
        return 1 + sum(1 for name in self.arrays if name.startswith(GROUP_ARRAYS[0] + ":"))


def array_names(groups: int) -> list[str]:
    """The names of a step's host arrays for `groups` layer groups (none for 0), in wire order."""
    if not groups:
        return []
    return [*ARRAYS, *(f"{name}:{g}" for g in range(1, groups) for name in GROUP_ARRAYS)]
