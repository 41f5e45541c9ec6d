"""CacheConfig and KVLayout: sizes, validation messages, fingerprints."""

import pytest
import torch

from tierkv import CacheConfig, KVLayout
from tierkv.config import parse_size
from tierkv.errors import ConfigError


@pytest.mark.parametrize(
    "text, expected",
    [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5G", int(1.5 * 2**30)),
     ("100", 100), ("4 KiB", 4096), ("1tb", 10**12), (4096, 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", -5, "lots", "8 GiBs", "1.2.3G", True])
def test_parse_size_rejects_with_field_name(bad):
    with pytest.raises(ConfigError, match="CacheConfig.l2"):
        CacheConfig(l2=bad)


def test_negative_size_says_negative():
    with pytest.raises(ConfigError, match="must not be negative"):
        CacheConfig(l1="-1GiB")


def test_unknown_policies_list_the_accepted_values():
    with pytest.raises(ConfigError, match=r"eviction 'fifo' is unknown; accepted: lru, lfu, s3fifo, priority"):
        CacheConfig(eviction="fifo")
    with pytest.raises(ConfigError, match=r"write_policy 'sometimes'.*write_through, write_back, selective"):
        CacheConfig(write_policy="sometimes")
    with pytest.raises(ConfigError, match="selective_min_hits"):
        CacheConfig(write_policy="selective", selective_min_hits=0)


@pytest.mark.parametrize(
    "url, message",
    [
        ("/var/cache/tierkv", "is not a URL"),
        ("ftp://host/x", "accepted schemes: file, redis, rediss, s3"),
        ("file://relative/path", "absolute path"),
        ("redis:///0", "needs a host"),
        ("s3:///prefix", "needs a bucket"),
        ("redis://127.0.0.1:notaport/0", "port that is not a number"),
        ("file:///tmp/x?size=huge", "size"),
    ],
)
def test_malformed_l3_urls_are_named(url, message):
    with pytest.raises(ConfigError, match="CacheConfig.l3") as err:
        CacheConfig(l3=[url])
    assert message in str(err.value)


def test_valid_l3_urls_pass_through():
    urls = ["file:///var/cache/tierkv?size=500GiB", "redis://127.0.0.1:6379/0", "rediss://:pw@host:6380/1",
            "s3://bucket/prefix?endpoint=http://127.0.0.1:8333"]
    assert CacheConfig(l3=urls).l3 == urls
    assert CacheConfig(l3=urls[0]).l3 == [urls[0]]  # a single URL is taken as a list of one


def test_layout_sizes_and_fingerprint():
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    assert layout.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert layout.bytes_per_block == 16 * layout.bytes_per_token == 2 * 2**20
    assert layout.block_shape == (32, 2, 16, 8, 128)
    assert layout.fingerprint == KVLayout(32, 8, 128, torch.bfloat16, 16).fingerprint
    others = {KVLayout(32, 8, 128, torch.float16, 16), KVLayout(32, 8, 128, torch.bfloat16, 32),
              KVLayout(16, 8, 128, torch.bfloat16, 16), KVLayout(32, 4, 128, torch.bfloat16, 16),
              KVLayout(32, 8, 64, torch.bfloat16, 16)}
    assert len({o.fingerprint for o in others} | {layout.fingerprint}) == 6


@pytest.mark.parametrize("field, value", [("num_layers", 0), ("head_dim", -1), ("block_size", 2.5)])
def test_layout_rejects_bad_values(field, value):
    kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    kwargs[field] = value
    with pytest.raises(ConfigError, match=f"KVLayout.{field}"):
        KVLayout(**kwargs)
    with pytest.raises(ConfigError, match="not supported"):
        KVLayout(2, 2, 8, dtype=torch.int32)
