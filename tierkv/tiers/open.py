"""open: the L3 store a URL names (file://, s3://, redis[s]://, redis+cluster://).

The factory lives apart from l3.py, the interface the stores subclass, so imports point one way:
open -> disk/s3/redis -> l3. It must never hold store logic; a store's options are its own.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..config import redact_url, validate_l3_url
from ..errors import ConfigError
from ..layout import KVLayout
from .l3 import L3Store


def open_store(url: str, layout: KVLayout) -> L3Store:
    """The store a URL names: file:///dir?size=..., s3://bucket/prefix?endpoint=..., redis[s]://host:port/db.

    Raises ConfigError for a URL that cannot work (unknown scheme or option, missing client
    library); a service that is down at open time is not an error (its calls miss until it is up).
    """
    validate_l3_url(url, "L3 URL")
    scheme = urlsplit(url).scheme
    try:
        if scheme == "file":
            from .disk import DiskStore

            return DiskStore(url, layout)
        if scheme == "s3":
            from .s3 import S3Store

            return S3Store(url, layout)
        from .redis import RedisStore

        return RedisStore(url, layout)
    except ModuleNotFoundError as err:
        extra = "s3" if scheme == "s3" else "redis"
        raise ConfigError(f"L3 URL {redact_url(url)} needs {err.name}: pip install 'tierkv[{extra}]'") from None
