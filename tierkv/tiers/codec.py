"""codec: one KV block <-> the bytes of one record of an L3 object, and the checks that make a read trustworthy.

    record = prefix (magic "TKV1", u32 header length, u32 payload offset)
             + msgpack header + zero padding up to the payload offset
             + raw payload (the block, [layers, 2, block_size, kv_heads, head_dim], as stored in L2)
             + zero padding up to a multiple of the store's alignment

An L3 object is one record (Redis) or a run of records of consecutive blocks of one chain (a
chunk, see chunks.py); every record has the same size in a store, so record j sits at j * record_size.
The header holds the format version, the layout fingerprint, the block's hash, parent hash,
namespace, chain position and token ids, the payload length and the xxh3-64 checksum of the
payload. A reader checks every one of them against what it asked for; anything else raises
`DecodeError`, which the stores turn into a counted miss. It decodes only msgpack data (never
Python objects), never does I/O and never logs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from ..layout import KVLayout

# 2: the header holds the block's chain position (objects hold chunks of records). Version 1
# objects (one object per block, no position) are refused as a "layout" miss, never guessed at.
FORMAT_VERSION = 2
MAGIC = b"TKV1"
_PREFIX = struct.Struct("<4sII")  # magic, msgpack header length, payload offset
PREFIX_SIZE = _PREFIX.size
NAMESPACE_SIZE = 16
# Bytes a header may take besides the token ids: version (1) + fingerprint str (<= 2 + 255)
# + 3 x 16-byte bin (hash, parent, ns: 18 each) + tokens bin header (5) + payload len (9)
# + checksum (9) + position (9) + map header and 9 short key strings (~60). Rounded up generously.
_HEADER_SLACK = 512


class DecodeError(Exception):
    """An object is not the block that was asked for; `kind` names why (for error counters)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BlockId:
    """Everything that names one block: a read is accepted only if the stored header equals it.

    hash: the chained xxh3-128 hash (tierkv.hashing), parent: the previous block's hash (0 for
    the first block), ns: the 16-byte namespace digest, tokens: the block's token ids as
    little-endian int32 bytes (4 * block_size bytes), pos: the block's position in its chain
    (0 for the first block; -1 where unknown, which only a store without chunks accepts).
    """

    hash: int
    parent: int
    ns: bytes
    tokens: bytes
    pos: int = -1

    def chain_ok(self) -> bool:
        """True when `hash` really is the chained hash of (parent, ns, tokens)."""
        expect = xxhash.xxh3_128_intdigest(self.parent.to_bytes(16, "little") + self.ns + self.tokens)
        return expect == self.hash


def key_hex(h: int) -> str:
    """The object name of a block hash: 32 lowercase hex digits."""
    return f"{h:032x}"


def byte_view(buf: Any) -> memoryview:
    """A flat, contiguous uint8 memoryview over a tensor (CPU), numpy array, bytes or bytearray.

    No copy: writing into the view of a writable buffer writes into the caller's memory (an L2
    slot), which is how reads land straight in place.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("L3 buffers must be contiguous CPU tensors (an L2 slot)")
        # view(uint8) reinterprets bf16/fp8 without a copy (numpy has no bfloat16 of its own); an
        # fp8 L2 slot is bytes already. One torch op at most: the L3 writer makes a view per block.
        if buf.dtype != torch.uint8:
            buf = buf.reshape(-1).view(torch.uint8) if buf.dim() == 0 else buf.view(torch.uint8)
        buf = buf.numpy()
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("L3 buffers must be C-contiguous")
        buf = buf.reshape(-1).view(np.uint8)
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1 or not view.contiguous:
        view = view.cast("B")
    return view


def payload_offset(layout: KVLayout, align: int = 1) -> int:
    """Where the payload starts in an object of `layout`: a pure function of the layout.

    The header is padded to a fixed size so that a reader knows the offset before it has read
    anything (one read call for header and payload), and, with align=4096, the payload sits on a
    page boundary in a file (O_DIRECT, page-cache friendly).
    """
    bound = PREFIX_SIZE + _HEADER_SLACK + 4 * layout.block_size
    return -(-bound // align) * align


# Payloads from this size up are hashed by the streaming hasher, whose update() releases the GIL;
# the one-shot xxh3_64_intdigest holds it for the whole block (~40 us a MiB), time the engine's
# thread would spend waiting while an L3 thread hashes. Both give the same digest.
_GIL_FREE_HASH_BYTES = 1 << 16


def checksum(payload: memoryview) -> int:
    """xxh3-64 of `payload` (the L3 record checksum)."""
    if len(payload) < _GIL_FREE_HASH_BYTES:
        return xxhash.xxh3_64_intdigest(payload)
    hasher = xxhash.xxh3_64()
    hasher.update(payload)
    return hasher.intdigest()


def encode_header(layout: KVLayout, bid: BlockId, payload: memoryview, align: int = 1) -> bytes:
    """Prefix + msgpack header + padding for `payload`; the object is this followed by the payload.

    The payload is not copied here, so a file can be written with one writev of both parts.
    """
    if len(payload) != layout.bytes_per_block:
        raise ValueError(f"payload is {len(payload)} bytes, the layout's block is {layout.bytes_per_block}")
    header = msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "layout": layout.fingerprint,
            "hash": bid.hash.to_bytes(16, "little"),
            "parent": bid.parent.to_bytes(16, "little"),
            "ns": bytes(bid.ns),
            "tokens": bytes(bid.tokens),
            "pos": bid.pos,
            "len": len(payload),
            "xxh3": checksum(payload),
        }
    )
    offset = payload_offset(layout, align)
    if PREFIX_SIZE + len(header) > offset:  # only a fingerprint far longer than any layout makes
        raise ValueError("block header does not fit its reserved space")
    pad = offset - PREFIX_SIZE - len(header)
    return _PREFIX.pack(MAGIC, len(header), offset) + header + bytes(pad)


def encode(layout: KVLayout, bid: BlockId, payload: Any) -> bytes:
    """The whole object as one bytes value (for stores whose API takes one value: Redis, S3)."""
    view = byte_view(payload)
    return b"".join((encode_header(layout, bid, view), view))


def record_size(layout: KVLayout, align: int = 1) -> int:
    """Bytes of one record: header area + payload, padded so the next record starts aligned."""
    return payload_offset(layout, align) + -(-layout.bytes_per_block // align) * align


def parse_header(layout: KVLayout, head: bytes | memoryview, align: int = 1) -> tuple[BlockId, int]:
    """The block a record's header names and its payload checksum, once the header is known to
    be a well-formed one of `layout`. `head` holds at least `payload_offset(layout, align)`
    bytes of the record. Raises DecodeError."""
    want_offset = payload_offset(layout, align)
    if len(head) < PREFIX_SIZE:
        raise DecodeError("truncated", "shorter than the prefix")
    magic, hlen, offset = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise DecodeError("garbage", "bad magic")
    if offset != want_offset or PREFIX_SIZE + hlen > offset:
        # Another block size or alignment gives another offset: not ours to read.
        raise DecodeError("layout", f"payload offset {offset}, expected {want_offset}")
    if len(head) < PREFIX_SIZE + hlen:
        raise DecodeError("truncated", "header cut short")
    try:
        h = msgpack.unpackb(bytes(head[PREFIX_SIZE : PREFIX_SIZE + hlen]), raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises many types on garbage; all mean the same here
        raise DecodeError("garbage", f"header is not msgpack ({type(err).__name__})") from None
    if not isinstance(h, dict):
        raise DecodeError("garbage", "header is not a map")
    if h.get("v") == 1:
        raise DecodeError("layout", "format version 1 (one object per block, before chunked L3 objects): not read")
    if h.get("v") != FORMAT_VERSION:
        raise DecodeError("layout", f"format version {h.get('v')!r}")
    if h.get("layout") != layout.fingerprint or h.get("len") != layout.bytes_per_block:
        raise DecodeError("layout", f"stored layout {h.get('layout')!r}")
    fields = (h.get("hash"), h.get("parent"), h.get("ns"), h.get("tokens"))
    if not all(isinstance(f, bytes) for f in fields) or not isinstance(h.get("pos"), int) or not isinstance(h.get("xxh3"), int):
        raise DecodeError("garbage", "header fields missing")
    bid = BlockId(int.from_bytes(fields[0], "little"), int.from_bytes(fields[1], "little"), fields[2], fields[3], h["pos"])
    return bid, h["xxh3"]


def decode_header(layout: KVLayout, bid: BlockId, head: bytes | memoryview, align: int = 1) -> int:
    """Check the header at the start of `head` against `layout` and `bid`; return the checksum.

    `head` must hold at least `payload_offset(layout, align)` bytes. Raises DecodeError.
    """
    stored, xxh = parse_header(layout, head, align)
    if stored != bid:
        # A hash collision, a misnamed object or another branch of the chain: never served.
        raise DecodeError("mismatch", "header names another block")
    return xxh


def check_payload(payload: memoryview, expected: int) -> None:
    if checksum(payload) != expected:
        raise DecodeError("checksum", "payload checksum differs")


def decode_into(layout: KVLayout, bid: BlockId, data: bytes | memoryview, out: memoryview) -> None:
    """Check a whole object and copy its payload into `out`. Raises DecodeError.

    On an error `out` may hold part of the bad payload: the caller must treat it as empty.
    """
    xxh = decode_header(layout, bid, data)
    start = payload_offset(layout)
    end = start + layout.bytes_per_block
    if len(data) < end:
        raise DecodeError("truncated", f"{len(data)} bytes, expected {end}")
    if len(data) > end:
        raise DecodeError("garbage", "trailing bytes after the payload")
    if len(out) != layout.bytes_per_block:
        raise ValueError(f"output buffer is {len(out)} bytes, the layout's block is {layout.bytes_per_block}")
    payload = memoryview(data)[start:end]
    # Checked before the copy, so a bad object never touches the caller's buffer.
    check_payload(payload, xxh)
    out[:] = payload
