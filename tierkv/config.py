"""CacheConfig: how big each tier is and which policies run it, validated once at construction.

Sizes are bytes as ints or strings like "8GiB"; L3 tiers are URLs. Validation happens here so
that every later layer can trust the values; this file never touches memory, files or sockets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit, urlunsplit

from .errors import ConfigError

EVICTION_POLICIES = ("lru", "lfu", "s3fifo", "priority", "arc")
WRITE_POLICIES = ("write_through", "write_back", "selective")
L3_SCHEMES = ("file", "redis", "rediss", "s3", "redis+cluster", "rediss+cluster")
# what L2 and L3 may hold blocks in besides the model's dtype (layout.OffloadLayout describes it)
KV_OFFLOAD_DTYPES = ("fp8_e4m3",)

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, field_name: str = "size") -> int:
    """Bytes from an int or a string such as "8GiB", "500MB", "1.5G" (K/M/G/T alone are binary)."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name} must be a size like 8589934592 or '8GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{field_name} must not be negative, got {value!r}")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            if value.strip().startswith("-"):
                raise ConfigError(f"{field_name} must not be negative, got {value!r}")
            raise ConfigError(
                f"{field_name} must be a size like '8GiB', '512MiB', '2GB' or a number of bytes, "
                f"got {value!r} (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )
        return int(float(match.group(1)) * _UNITS[unit])
    raise ConfigError(f"{field_name} must be an int or a string like '8GiB', got {type(value).__name__}")


def redact_url(url: str) -> str:
    """The URL with any password and secret-looking query values replaced by '***' (safe to log)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rsplit("@", 1)[1]
        query = "&".join(
            f"{k}=***" if any(s in k.lower() for s in ("key", "secret", "token", "pass", "cred")) else f"{k}={v[0]}"
            for k, v in parse_qs(parts.query, keep_blank_values=True).items()
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return "<unparsable url>"


def redis_cluster_nodes(url: str, field_name: str = "l3") -> list[tuple[str, int]]:
    """The (host, port) seeds of a `redis+cluster://[:password@]host:port,host:port/` URL.

    Raises ConfigError for an empty host, a bad port, or a database other than 0 (a cluster has one).
    """
    parts = urlsplit(url)
    hosts = parts.netloc.rsplit("@", 1)[-1]
    example = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000/"
    nodes = []
    for item in hosts.split(","):
        host = urlsplit("//" + item.strip())
        try:
            port = 6379 if host.port is None else host.port
            if not 0 < port < 65536:
                raise ValueError(port)
        except ValueError:
            raise ConfigError(f"{field_name} entry {redact_url(url)!r}: node {item!r} has a port that is not a "
                              f"number from 1 to 65535; use {example}") from None
        if not host.hostname:
            raise ConfigError(f"{field_name} entry {redact_url(url)!r} needs host:port of one or more cluster "
                              f"nodes, comma-separated: {example}")
        nodes.append((host.hostname, port))
    if parts.path not in ("", "/", "/0"):
        raise ConfigError(f"{field_name} entry {redact_url(url)!r} names database {parts.path[1:]!r}; "
                          f"a Redis Cluster has only database 0: {example}")
    return nodes


def validate_l3_url(url: str, field_name: str = "l3") -> str:
    """Check that `url` names a known L3 tier with the parts it needs; return it unchanged."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"{field_name} entry {url!r} is not a URL; use file:///path?size=100GiB, "
            "redis://host:port/db, rediss://..., redis+cluster://host:port,host:port/, "
            "or s3://bucket/prefix?endpoint=http://host:port"
        )
    parts = urlsplit(url)
    if parts.scheme not in L3_SCHEMES:
        raise ConfigError(
            f"{field_name} entry {url!r} has scheme {parts.scheme!r}; accepted schemes: {', '.join(L3_SCHEMES)}"
        )
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path.startswith("/")):
        raise ConfigError(f"{field_name} entry {url!r} needs an absolute path: file:///var/cache/tierkv?size=100GiB")
    if parts.scheme in ("redis", "rediss") and not parts.hostname:
        raise ConfigError(f"{field_name} entry {url!r} needs a host: redis://127.0.0.1:6379/0")
    if parts.scheme == "s3" and not parts.netloc:
        raise ConfigError(f"{field_name} entry {url!r} needs a bucket: s3://bucket/prefix?endpoint=http://127.0.0.1:8333")
    if parts.scheme.endswith("+cluster"):
        redis_cluster_nodes(url, field_name)  # several host:port, each checked there
    else:
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ConfigError(f"{field_name} entry {url!r} has a port that is not a number") from None
    query = parse_qs(parts.query)
    if "size" in query:
        parse_size(query["size"][0], f"{field_name} entry {url!r} size")
    return url


def require_l2_for_l3(l3: list[str] | tuple[str, ...], l2: int, why: str = "") -> None:
    """An L3 needs an L2: blocks move L1 <-> L2 <-> L3, never between L1 and L3 directly. `l2`: the
    L2's size in bytes or blocks, 0 when it is off; `why`: what turned it off, for the message.

    The one place this rule lives. EngineConfig checks it as soon as the options and the device are
    known (before a weight loads); Tiering checks the block count when the cache is made. The
    message names CacheConfig's fields; tierkv-serve prints its flags for them.
    """
    if l3 and not l2:
        raise ConfigError(f"CacheConfig.l3 needs an L2 pool to stage blocks through: set CacheConfig.l2 > 0{why}")


@dataclass(slots=True)
class CacheConfig:
    """Sizes and policies of the three tiers.

    l1: bytes of the GPU (or CPU, for tests) paged pool; None picks 1 GiB on CPU and, on a
        GPU, 80% of the memory free when the cache is made less 4 GiB for activations (so make
        the cache after loading the model's weights).
    l2: bytes of the pinned host pool; 0 disables L2.
    l3: URLs of the shared tiers, searched in order.
    eviction: one of EVICTION_POLICIES, used by every tier.
    write_policy: when a block is copied down a tier: "write_through" (as soon as it is full),
        "write_back" (when it is evicted), "selective" (after `selective_min_hits` hits).
    kv_offload_dtype: None keeps L2 and L3 blocks in the model's dtype; "fp8_e4m3" stores them
        as fp8 with a scale per block, layer, K/V and head (layout.OffloadLayout): about half
        the bytes of bf16, so twice the blocks in the same L2 and L3 and half the PCIe and disk
        traffic, at the cost of fp8 rounding (up to ~3.5% of a head's largest value). L1
        keeps the model's dtype; blocks are converted on the device as they move.
    l2_file: None keeps L2 in this process's memory; a path (under /dev/shm) makes L2 a shared
        memory file there, created by the cache, that other processes map with
        `HostPool.attach` (an engine whose workers run the L1<->L2 copies: the vLLM connector).
    """

    l1: int | str | None = None
    l2: int | str = 0
    l3: list[str] = field(default_factory=list)
    eviction: str = "lru"
    write_policy: str = "write_through"
    selective_min_hits: int = 2
    kv_offload_dtype: str | None = None
    l2_file: str | None = None

    def __post_init__(self) -> None:
        if self.l1 is not None:
            self.l1 = parse_size(self.l1, "CacheConfig.l1")
        self.l2 = parse_size(self.l2, "CacheConfig.l2")
        if isinstance(self.l3, str):
            self.l3 = [self.l3]
        self.l3 = [validate_l3_url(u, "CacheConfig.l3") for u in self.l3]
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"CacheConfig.eviction {self.eviction!r} is unknown; accepted: {', '.join(EVICTION_POLICIES)}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"CacheConfig.write_policy {self.write_policy!r} is unknown; accepted: {', '.join(WRITE_POLICIES)}"
            )
        if not isinstance(self.selective_min_hits, int) or self.selective_min_hits < 1:
            raise ConfigError(
                f"CacheConfig.selective_min_hits must be an int >= 1, got {self.selective_min_hits!r}"
            )
        check_offload_dtype(self.kv_offload_dtype, "CacheConfig.kv_offload_dtype")


def check_offload_dtype(value: object, field_name: str = "kv_offload_dtype") -> str | None:
    """`value` if it is None or one of KV_OFFLOAD_DTYPES; otherwise a ConfigError naming them."""
    if value is not None and value not in KV_OFFLOAD_DTYPES:
        raise ConfigError(f"{field_name} {value!r} is unknown; accepted: {', '.join(KV_OFFLOAD_DTYPES)}, "
                          "or None for the model's dtype")
    return value
