"""AttentionMetadata and the attention call of one decoder layer into the paged L1 pool.

The runner builds one `AttentionMetadata` per step and hands it to the model explicitly; this
file never keeps state between calls (no module globals) and never allocates or frees blocks:
the model writes this step's K/V into slots the scheduler already owns, then attends through them.
Sequences larger than L1 ("streamed") attend over a staging buffer that `LayerStream` fills
with the layer's KV from L2 and L1; they come last in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierkv import kernels
from tierkv.streaming import LayerStream


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged pool and which logits the step needs.

    The batch is flat: T new tokens of B sequences laid end to end, sequence b owning tokens
    cu_seqlens_q[b]:cu_seqlens_q[b + 1]. All tensors sit on the model's device.

    slot_mapping:   [T] int64, pool slot of each new token (block * block_size + offset); -1 skips
                    the write (padding rows of a CUDA-graph batch).
    block_tables:   [B, max_blocks] int32, the blocks of each sequence in order (pad anything).
    seq_lens:       [B] int32, tokens of each sequence after this step (cached prefix + new).
    cu_seqlens_q:   [B + 1] int32, prefix sums of the new-token counts (0 first).
    logits_indices: [n] int64, indices into the T tokens whose logits the step returns, usually
                    the last new token of each sequence that finishes its prompt or decodes.
    is_decode:      True when every sequence has exactly one new token (T == B); the model then
                    uses the decode kernel, which is cheaper and CUDA-graph friendly.
    context:        when the batch is one sequence, its cached tokens before this step (host int):
                    lets a long prefill chunk take the kernels' dense path.
    streamed:       set when the batch ends with streamed sequences (see StreamedAttention).
    wait_layer:     set when L2 -> L1 loads into the batch's blocks are in flight: called with
                    layer i before layer i reads the pool, it orders the stream after that layer's loads.
    groups:         a model whose layers keep their KV in caches of their own (tierkv/groups.py):
                    each group's metadata, this one first (the group that may stream). They
                    differ in slot_mapping and block_tables only; layer i reads
                    groups[layer_group[i]] (`for_layer`).
    plans:          the prefill kernel's launch plans for this batch, made by its first layer and
                    taken by the others (kernels.paged_prefill); never carried into another step.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool = False
    context: int | None = None
    streamed: StreamedAttention | None = None
    wait_layer: Callable[[int], None] | None = None
    groups: list[AttentionMetadata] | None = None
    layer_group: list[int] | None = None
    plans: dict = field(default_factory=dict)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata model layer `layer` reads: its group's (itself without groups)."""
        return self if self.groups is None else self.groups[self.layer_group[layer]]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(slots=True)
class StreamedAttention:
    """The split of a batch whose last sequences are streamed.

    first_token: new tokens [0, first_token) belong to the L1-only sequences, the rest to the
                 streamed ones.
    head:        metadata of the L1-only sequences (None if there are none).
    tail:        metadata of the streamed sequences; its block_tables index the staging buffer.
    stream:      the step's LayerStream, which fills that buffer layer by layer.
    layer_of:    with layer groups, each model layer's place among the streamed group's layers
                 (the stream's layer numbers); None: the same.
    """

    first_token: int
    head: AttentionMetadata | None
    tail: AttentionMetadata
    stream: LayerStream
    layer_of: list[int] | None = None


def _attend(q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
            sinks: torch.Tensor | None = None):
    if meta.is_decode:  # one query per sequence: [B, Hq, D] with B == T
        return kernels.paged_decode(q, kv, meta.block_tables, meta.seq_lens, scale, window, sinks)
    return kernels.paged_prefill(q, kv, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale, window,
                                 meta.context, sinks, meta.plans)


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    layer: int = 0,
    attend: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend each new query over its whole sequence, whose K/V (this step's included) the
    caller has already written into the pool (`kernels.rope_kv_write`): the kernels read every
    key through the pool, so the new tokens see themselves (causal includes the diagonal).

    q: [T, Hq, D] (rotated); kv: layer `layer`'s pool [num_blocks, 2, block_size, Hkv, D].
    Returns [T, Hq, D] in q's dtype.
    attend: an attention of its own, attend(q, kv, meta) -> [T, Hq, Dv], that reads another pool
    layout (mla.py's latents); streamed sequences go through it the same way.
    sinks: None, or this rank's [Hq] attention-sink logits (gpt-oss; see kernels.paged_decode).
    """
    if attend is None:
        def attend(q, kv, meta):
            return _attend(q, kv, meta, scale, sliding_window, sinks)
    s = meta.streamed
    if s is None:
        return attend(q, kv, meta)
    at = layer if s.layer_of is None else s.layer_of[layer]  # the layer as the stream numbers it
    staged = s.stream.layer_kv(at, kv)  # [rows, 2, bs, Hkv, D]: this layer's KV of the streamed sequences
    out_tail = attend(q[s.first_token :], staged, s.tail)
    s.stream.release(at)
    if s.head is None:
        return out_tail
    return torch.cat([attend(q[: s.first_token], kv, s.head), out_tail])
