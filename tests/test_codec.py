"""tierkv/tiers/codec.py and the shared parts of tierkv/tiers/l3.py and chunks.py: a wrong object is a miss,
never data."""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from services import block_chain, same_bytes

from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.tiers.codec import BlockId, DecodeError, byte_view, decode_into, encode, parse_header, payload_offset
from tierkv.config import redact_url
from tierkv.tiers.open import open_store

SMALL = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_size=2)


def _obj(layout=SMALL, seed=0):
    ids, pays = block_chain(layout, 2, seed)
    return ids, pays, encode(layout, ids[1], pays[1])


def test_roundtrip_writes_the_payload_into_the_callers_buffer():
    ids, pays, data = _obj()
    out = torch.zeros(SMALL.block_shape, dtype=SMALL.dtype)
    decode_into(SMALL, ids[1], data, byte_view(out))
    assert same_bytes(out, pays[1])
    assert len(data) == payload_offset(SMALL) + SMALL.bytes_per_block


def test_every_single_byte_flip_is_a_miss_or_the_exact_payload():
    ids, pays, data = _obj()
    out = bytearray(SMALL.bytes_per_block)
    served_intact = 0
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        try:
            decode_into(SMALL, ids[1], bytes(bad), memoryview(out))
        except DecodeError:
            continue
        served_intact += 1
        assert bytes(out) == bytes(byte_view(pays[1])), f"flip at {pos} served wrong data"
    # Only the zero padding between header and payload may be flipped without a miss.
    assert served_intact <= payload_offset(SMALL) - 12 - 100


def test_every_truncation_is_a_truncated_or_garbage_miss():
    ids, _, data = _obj()
    out = memoryview(bytearray(SMALL.bytes_per_block))
    kinds = set()
    for n in range(len(data)):
        with pytest.raises(DecodeError) as err:
            decode_into(SMALL, ids[1], data[:n], out)
        kinds.add(err.value.kind)
    assert kinds <= {"truncated", "layout", "garbage"} and "truncated" in kinds


def test_trailing_bytes_are_rejected():
    ids, _, data = _obj()
    with pytest.raises(DecodeError, match="garbage"):
        decode_into(SMALL, ids[1], data + b"\0", memoryview(bytearray(SMALL.bytes_per_block)))


def test_other_layout_is_a_layout_miss():
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16, block_size=2)
    ids, _, data = _obj()
    with pytest.raises(DecodeError) as err:
        decode_into(other, ids[1], data, memoryview(bytearray(other.bytes_per_block)))
    assert err.value.kind == "layout"


@pytest.mark.parametrize("field", ["hash", "parent", "ns", "tokens"])
def test_header_naming_another_block_is_a_mismatch(field):
    ids, _, data = _obj()
    b = ids[1]
    changed = {
        "hash": BlockId(b.hash ^ 1, b.parent, b.ns, b.tokens),
        "parent": BlockId(b.hash, b.parent ^ 1, b.ns, b.tokens),
        "ns": BlockId(b.hash, b.parent, bytes(16), b.tokens),
        "tokens": BlockId(b.hash, b.parent, b.ns, bytes(len(b.tokens))),
    }[field]
    with pytest.raises(DecodeError) as err:
        decode_into(SMALL, changed, data, memoryview(bytearray(SMALL.bytes_per_block)))
    assert err.value.kind == "mismatch"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_never_raises_anything_but_decode_error(blob):
    ids, _, _ = _obj()
    with pytest.raises(DecodeError):
        decode_into(SMALL, ids[1], blob, memoryview(bytearray(SMALL.bytes_per_block)))


def test_bad_checksum_does_not_touch_the_output_buffer():
    ids, _, data = _obj()
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    out = bytearray(b"\xaa" * SMALL.bytes_per_block)
    with pytest.raises(DecodeError, match="checksum"):
        decode_into(SMALL, ids[1], bytes(bad), memoryview(out))
    assert out == bytearray(b"\xaa" * SMALL.bytes_per_block)


def test_chain_ok_detects_a_mislabeled_block(tmp_path):
    ids, pays = block_chain(SMALL, 2)
    assert all(b.chain_ok() for b in ids)
    liar = BlockId(ids[0].hash, ids[1].parent, ids[1].ns, ids[1].tokens)
    assert not liar.chain_ok()
    store = open_store(f"file://{tmp_path}/d?size=1MiB", SMALL)
    with pytest.raises(ValueError):
        store.put_many([liar], [pays[1]])
    store.close()


def test_format_1_objects_are_refused_with_a_clear_reason():
    ids, _, data = _obj()
    old = data.replace(b"\xa1v\x02", b"\xa1v\x01", 1)  # the header's "v": 1, as before chunk objects
    with pytest.raises(DecodeError, match="format version 1") as err:
        parse_header(SMALL, old)
    assert err.value.kind == "layout"
    assert parse_header(SMALL, data) == (ids[1], parse_header(SMALL, data)[1])


def test_a_block_at_another_chain_position_is_a_mismatch():
    ids, _, data = _obj()
    moved = BlockId(ids[1].hash, ids[1].parent, ids[1].ns, ids[1].tokens, ids[1].pos + 16)
    with pytest.raises(DecodeError, match="mismatch"):
        decode_into(SMALL, moved, data, memoryview(bytearray(SMALL.bytes_per_block)))


def test_chunked_stores_need_chain_positions(tmp_path):
    ids, pays = block_chain(SMALL, 2)
    store = open_store(f"file://{tmp_path}/d?size=1MiB", SMALL)
    unplaced = [BlockId(b.hash, b.parent, b.ns, b.tokens) for b in ids]
    with pytest.raises(ValueError, match="position"):
        store.put_many(unplaced, pays)
    with pytest.raises(ValueError, match="position"):
        store.get_many(unplaced, pays)
    with pytest.raises(ConfigError, match="chunk"):
        open_store(f"file://{tmp_path}/e?size=1MiB&chunk=3", SMALL)
    store.close()


def test_redact_url_hides_passwords_and_keys():
    red = redact_url("redis://:hunter2@10.0.0.1:6379/0?ttl=5&secret_key=abc")
    assert "hunter2" not in red and "abc" not in red and "10.0.0.1:6379" in red and "ttl=5" in red


def test_open_store_rejects_unknown_options_and_schemes(tmp_path):
    with pytest.raises(ConfigError, match="unknown options"):
        open_store(f"file://{tmp_path}?size=1MiB&sise=2", SMALL)
    with pytest.raises(ConfigError):
        open_store("ftp://x/y", SMALL)
    with pytest.raises(ConfigError, match="size"):
        open_store(f"file://{tmp_path}?size=lots", SMALL)


def test_no_pickle_in_the_l3_code():
    tiers = pathlib.Path(__file__).parent.parent / "tierkv" / "tiers"
    for name in ("codec.py", "l3.py", "chunks.py", "disk.py", "s3.py", "redis.py"):
        assert "pickle" not in (tiers / name).read_text(), name
