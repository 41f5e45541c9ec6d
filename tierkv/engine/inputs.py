"""StepInputs: a scheduled step's flat batch, built in pinned host buffers and copied to the device.

The batch is the new tokens of every sequence laid end to end: token ids, positions, pool slots,
block tables, lengths and the rows that sample. Everything is filled with numpy into host
buffers allocated once (pinned on a GPU) and sent, all of a step in one `kernels.upload` call,
into device buffers allocated once, so building a step allocates nothing in proportion to batch x
tokens and never waits for the GPU. On a GPU that call is one kernel reading the pinned arrays
itself: copies by the copy engines would wait behind an L2 load's DMAs, and the step with them
(kernels/array_upload.py). Two host sets are used in turn: the engine waits for step N before it
builds step N+2, so a set is never refilled while its upload may still be in flight.

A token sampled by the previous step but not yet back on the host ("pending", with overlap)
is read on the device from that step's sampled tokens. This file never schedules, never runs
the model and never touches the cache's bookkeeping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tierkv import kernels

from ..sequence import fill_block_table
from .attention import AttentionMetadata
from .request import Request


@dataclass(slots=True)
class BuiltStep:
    """One step's device inputs and the requests (in row order) whose last new token samples."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sampling: list[Request]
    cu: list[int]  # [B + 1] prefix sums of the new-token counts, on the host
    host: dict[str, np.ndarray]  # step_plan.ARRAYS -> this step's host arrays (views; refilled two steps on)
    width: int  # block table columns


class _HostSet:
    """Host-side arrays of one step (pinned on a GPU), with numpy views to fill them, and the
    UploadTable that pairs them with the device buffers (`pair`)."""

    def __init__(self, sizes: dict[str, int], pin: bool) -> None:
        self.tensors = {
            name: torch.zeros(n, dtype=torch.int32 if name.split(":")[0] in _INT32 else torch.int64, pin_memory=pin)
            for name, n in sizes.items()
        }
        self.np = {name: t.numpy() for name, t in self.tensors.items()}
        self.names = list(self.tensors)
        self.table = None

    def pair(self, device_buffers: dict[str, torch.Tensor]) -> None:
        self.table = kernels.UploadTable([self.tensors[n] for n in self.names],
                                         [device_buffers[n] for n in self.names])


# int32 on the device (the kernels' index type); everything else int64. With layer groups, group
# g > 0 has arrays of its own named "slot_mapping:g" and "block_tables:g".
_INT32 = ("block_tables", "seq_lens", "cu_seqlens_q")


class StepInputs:
    def __init__(self, *, block_size: int, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device, layer_group: list[int] | None = None) -> None:
        """`layer_group`: a model whose layer groups keep their KV in caches of their own
        (tierkv/groups.py): each layer's group. Each group then has a slot mapping and block
        tables of its own, from its own slots (`build`'s `tables`, a list per group)."""
        self.block_size, self.device = block_size, device
        self.layer_group = layer_group
        self.num_groups = 1 if layer_group is None else max(layer_group) + 1
        self._pin = device.type == "cuda"
        self._sizes = {
            "input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
            "block_tables": max_seqs * max_blocks, "seq_lens": max_seqs, "cu_seqlens_q": max_seqs + 1,
            "logits_indices": max_seqs, "pending_at": max_seqs, "pending_from": max_seqs,
        }
        for g in range(1, self.num_groups):
            self._sizes |= {f"slot_mapping:{g}": max_tokens, f"block_tables:{g}": max_seqs * max_blocks}
        self._allocate()

    def _allocate(self) -> None:
        self._hosts = [_HostSet(self._sizes, self._pin) for _ in range(2)]
        self._turn = 0
        self._dev = {name: torch.zeros_like(t, device=self.device) for name, t in self._hosts[0].tensors.items()}
        for host in self._hosts:
            host.pair(self._dev)

    def compile(self) -> None:
        """Upload one word now, so that Triton compiles `kernels.upload` before the first step
        (it would stall that step for ~0.1 s). The word is input_ids[0], which every step rewrites."""
        if self.device.type == "cuda":
            host = self._hosts[self._turn]
            kernels.upload(host.table, [1 if name == "input_ids" else 0 for name in host.names])

    def _fit(self, **needed: int) -> None:
        """Grow every buffer that is too small for this step (rare: a first long table, say)."""
        grow = {name: max(n, 2 * self._sizes[name]) for name, n in needed.items() if n > self._sizes[name]}
        if grow:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # in-flight copies read the old sets
            self._sizes.update(grow)
            self._allocate()

    def build(self, requests: list[Request], num_new: list[int], tables: list[list[list[int]]],
              previous: tuple[list[Request], torch.Tensor] | None) -> BuiltStep:
        """The step's inputs; `tables[g][b]` is sequence b's L1 slots in layer group g (one group
        without groups); `previous` is the last step's sampling requests and their sampled
        tokens [n] on the device, for pending tokens."""
        b_count, bs = len(requests), self.block_size
        new = np.asarray(num_new, dtype=np.int64)  # [B]
        starts = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=b_count)  # [B]
        ends = starts + new
        cu = np.zeros(b_count + 1, dtype=np.int64)
        np.cumsum(new, out=cu[1:])
        total = int(cu[-1])
        width = max((len(t) for group in tables for t in group), default=0)
        self._fit(input_ids=total, logits_indices=b_count, pending_at=b_count, pending_from=b_count,
                  **self._step_sizes(total, b_count, width))
        host = self._hosts[self._turn]
        self._turn ^= 1
        h = host.np

        # token ids: what the host knows; a pending token (always a sequence's last) is a
        # placeholder here, filled on the device from the previous step's sampled tokens
        ids: list[int] = []
        pending_at: list[int] = []
        pending_from: list[int] = []
        rows = {id(r): i for i, r in enumerate(previous[0])} if previous is not None else {}
        for b, (r, start, end) in enumerate(zip(requests, starts.tolist(), ends.tolist())):
            if r.pending and end > r.num_known:  # the one token still on its way from the GPU
                ids += r.tokens(start, end - 1)
                ids.append(0)
                pending_at.append(int(cu[b + 1]) - 1)
                pending_from.append(rows[id(r)])
            else:
                ids += r.tokens(start, end)
        h["input_ids"][:total] = ids
        row = np.repeat(np.arange(b_count), new)  # [T]: which sequence
        positions = h["positions"][:total]
        np.subtract(np.arange(total), np.repeat(cu[:-1] - starts, new), out=positions)  # [T]
        for g, group in enumerate(tables):  # each group's slots: [B, width] tables, [T] slots
            at = f":{g}" if g else ""
            table = fill_block_table(group, h["block_tables" + at][: b_count * width].reshape(b_count, width))
            np.add(table[row, positions // bs].astype(np.int64) * bs, positions % bs, out=h["slot_mapping" + at][:total])
        h["seq_lens"][:b_count] = ends
        h["cu_seqlens_q"][: b_count + 1] = cu
        # the rows that finish their prompt or decode sample, from their last new token
        sample_rows = [b for b, r in enumerate(requests) if int(ends[b]) == r.num_tokens]
        h["logits_indices"][: len(sample_rows)] = cu[1:][sample_rows] - 1

        n = len(pending_at)
        h["pending_at"][:n], h["pending_from"][:n] = pending_at, pending_from
        dev, meta = self._to_device(host, total, b_count, width, len(sample_rows), bool((new == 1).all()),
                                    int(starts[0]) if b_count == 1 else None, pending=n)
        input_ids = dev["input_ids"]
        if n:
            input_ids.index_copy_(0, dev["pending_at"], previous[1].index_select(0, dev["pending_from"]))
        return BuiltStep(input_ids, dev["positions"], meta, [requests[b] for b in sample_rows], cu.tolist(),
                         self._views(host, total, b_count, width, len(sample_rows)), width)

    def load(self, arrays: dict[str, np.ndarray], width: int, is_decode: bool, context: int | None) -> BuiltStep:
        """Another tensor-parallel rank's step: rank 0's host arrays (step_plan.ARRAYS) to the device.
        Its token ids are left to the caller (broadcast from rank 0 on the device)."""
        total, b_count = len(arrays["positions"]), len(arrays["seq_lens"])
        n_sample = len(arrays["logits_indices"])
        self._fit(input_ids=total, logits_indices=n_sample, **self._step_sizes(total, b_count, width))
        host = self._hosts[self._turn]
        self._turn ^= 1
        for name, values in arrays.items():
            host.np[name][: len(values)] = values
        dev, meta = self._to_device(host, total, b_count, width, n_sample, is_decode, context)
        return BuiltStep(dev["input_ids"], dev["positions"], meta, [], arrays["cu_seqlens_q"].tolist(),
                         self._views(host, total, b_count, width, n_sample), width)

    def _step_sizes(self, total: int, b_count: int, width: int) -> dict[str, int]:
        """What a step of `total` tokens over `b_count` sequences and `width` table columns needs of
        the arrays that rank 0 sends to the other ranks (`_views`)."""
        sizes = {"positions": total, "slot_mapping": total, "block_tables": b_count * width, "seq_lens": b_count,
                 "cu_seqlens_q": b_count + 1}
        for g in range(1, self.num_groups):
            sizes |= {f"slot_mapping:{g}": total, f"block_tables:{g}": b_count * width}
        return sizes

    def _to_device(self, host: _HostSet, total: int, b_count: int, width: int, n_sample: int, is_decode: bool,
                   context: int | None, pending: int = 0) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """The step's arrays sent to the device in one upload (no wait): their device views by
        name, and the attention metadata built on them. `pending`: tokens read on the device."""
        counts = self._step_sizes(total, b_count, width) | {"input_ids": total, "logits_indices": n_sample,
                                                            "pending_at": pending, "pending_from": pending}
        kernels.upload(host.table, [counts.get(name, 0) for name in host.names])
        dev = {name: self._dev[name][:n] for name, n in counts.items()}
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], block_tables=dev["block_tables"].view(b_count, width),
            seq_lens=dev["seq_lens"], cu_seqlens_q=dev["cu_seqlens_q"], logits_indices=dev["logits_indices"],
            is_decode=is_decode, context=context,
        )
        if self.layer_group is not None:
            meta.groups = [meta] + [dataclasses.replace(
                meta, slot_mapping=dev[f"slot_mapping:{g}"],
                block_tables=dev[f"block_tables:{g}"].view(b_count, width)) for g in range(1, self.num_groups)]
            meta.layer_group = self.layer_group
        return dev, meta

    def _views(self, host: _HostSet, total: int, b_count: int, width: int, n_sample: int) -> dict[str, np.ndarray]:
        """The step's host arrays that another tensor-parallel rank needs (step_plan.ARRAYS and
        each further layer group's), as views of `host`."""
        sizes = self._step_sizes(total, b_count, width) | {"logits_indices": n_sample}
        return {name: host.np[name][:n] for name, n in sizes.items()}
