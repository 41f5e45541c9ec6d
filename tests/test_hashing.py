"""Chained block hashes: stable across processes, disjoint across namespaces, extendable."""

import json
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tierkv.hashing import hash_blocks, namespace, token_bytes

SCRIPT = """
import json
from tierkv.hashing import hash_blocks, namespace, token_bytes
tokens = list(range(1000, 1000 + 100)) + [2**31 - 1, 0, 7] * 9
out = {}
for salt in (None, "tenant-a", "tenant-b"):
    ns = namespace("model-a", "kv1-L2-H2-D8-float32-B16", 3, salt)
    out[str(salt)] = [str(h) for h in hash_blocks(token_bytes(tokens), 16, ns)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, list[int]]]:
    """The same hashes computed by two separate Python processes with different hash() seeds."""
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": "random", "PATH": ""})
        runs.append({salt: [int(h) for h in hs] for salt, hs in json.loads(out.stdout).items()})
    return runs


def test_two_processes_agree(two_processes):
    first, second = two_processes
    assert len(first["None"]) == (100 + 27) // 16
    assert first == second


def test_salts_give_disjoint_hashes(two_processes):
    by_salt = two_processes[0]
    assert not set(by_salt["tenant-a"]) & set(by_salt["tenant-b"])
    assert not set(by_salt["tenant-a"]) & set(by_salt["None"])


def test_formula_matches_design():
    """h_i = xxh3_128(h_{i-1} || namespace || token ids of block i as little-endian int32), h_-1 = 0."""
    ns = namespace("m", "layout", 0, None)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    expected, h = [], 0
    for i in range(2):
        block = np.array(tokens[i * 4 : (i + 1) * 4], dtype="<i4").tobytes()
        h = xxhash.xxh3_128_intdigest(h.to_bytes(16, "little") + ns + block)
        expected.append(h)
    assert hash_blocks(token_bytes(tokens), 4, ns) == expected


def test_namespace_separates_every_field():
    base = ("m", "layout", 0, None)
    variants = [("m2", "layout", 0, None), ("m", "layout2", 0, None), ("m", "layout", 1, None), ("m", "layout", 0, "s"),
                ("m", "layout", 0, "")]
    digests = {namespace(*v) for v in [base, *variants]}
    assert len(digests) == len(variants) + 1
    # No ambiguity from concatenation: fields are encoded, not glued together.
    assert namespace("ab", "c") != namespace("a", "bc")


@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=80), st.integers(0, 5))
def test_chain_extends_without_rehashing(tokens, split_block):
    ns = namespace("m", "l")
    tb = token_bytes(tokens)
    full = hash_blocks(tb, 4, ns)
    head = hash_blocks(tb, 4, ns, last_block=split_block)
    tail = hash_blocks(tb, 4, ns, parent=head[-1] if head else 0, first_block=len(head))
    assert head + tail == full
    assert len(full) == len(tokens) // 4  # only full blocks are hashed


def test_token_bytes_rejects_what_int32_cannot_hold():
    with pytest.raises(ValueError, match="int32"):
        token_bytes([2**31])
    with pytest.raises(ValueError, match="int32"):
        token_bytes([1.5])
    with pytest.raises(ValueError, match="flat"):
        token_bytes([[1, 2]])
