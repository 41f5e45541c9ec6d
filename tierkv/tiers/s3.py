"""s3: the S3 L3 store (`s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1`).

One object per block, `<prefix>/<32 hex>`, body = codec object. S3 has no multi-HEAD, so a
lookup is parallel HEADs (one round trip of latency); gets and puts run in parallel on a
thread pool. boto3's standard retry mode adds backoff; connect/read timeouts bound every call
and a short back-off skips calls while the service is down. Credentials come from boto3's usual
chain (env vars, ~/.aws files, instance roles) and are never logged; logged URLs are redacted.
Options: create_bucket=1, threads, timeout, connect_timeout, retries, addressing=path|virtual.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

from ..layout import KVLayout
from .codec import BlockId, DecodeError, decode_into, encode, key_hex
from .l3 import Breaker, L3Store, UrlOptions

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


class _Unavailable(Exception):
    pass


class S3Store(L3Store):
    name = "s3"

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("endpoint", "region", "create_bucket", "threads", "timeout",
                                "connect_timeout", "retries", "addressing"))
        threads = opts.get("threads", 16, int)
        super().__init__(layout, url, threads)
        parts = urlsplit(url)
        self.bucket = parts.netloc
        self.prefix = unquote(parts.path).strip("/")
        endpoint = opts.get("endpoint", None, str)
        config = Config(
            connect_timeout=opts.get("connect_timeout", 2.0, float),
            read_timeout=opts.get("timeout", 10.0, float),
            retries={"max_attempts": opts.get("retries", 3, int), "mode": "standard"},
            max_pool_connections=threads,
            # Self-hosted S3 (SeaweedFS, MinIO) on an IP endpoint needs path-style addressing.
            s3={"addressing_style": opts.get("addressing", "path" if endpoint else "auto", str)},
        )
        self._s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=opts.get("region", None, str), config=config
        )
        self._breaker = Breaker()
        if opts.get("create_bucket", False, UrlOptions.boolean):
            self._create_bucket()

    def _create_bucket(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
            return
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in _NOT_FOUND | {"NoSuchBucket"}:
                log.warning("s3 L3 %s: cannot check the bucket: %s", self.url, err)
                return
        except BotoCoreError as err:
            log.warning("s3 L3 %s: service not reachable at open: %s", self.url, err)
            return
        try:
            region = self._s3.meta.region_name
            kwargs = {}
            if region and region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            self._s3.create_bucket(Bucket=self.bucket, **kwargs)
            log.info("s3 L3 %s: created bucket %s", self.url, self.bucket)
        except (ClientError, BotoCoreError) as err:
            log.warning("s3 L3 %s: cannot create bucket %s: %s", self.url, self.bucket, err)

    def _key(self, h: int) -> str:
        return f"{self.prefix}/{key_hex(h)}" if self.prefix else key_hex(h)

    def _call(self, fn, *args, **kwargs):
        """One request; None for a missing key; classify failures for stats and the breaker."""
        if not self._breaker.allow():
            self._stats.error("unavailable")
            raise _Unavailable()
        try:
            out = fn(*args, **kwargs)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in _NOT_FOUND:
                self._breaker.success()
                return None
            self._stats.error("io")  # denied, no bucket, 5xx after retries: the service answered
            raise
        except (ConnectTimeoutError, ReadTimeoutError):
            self._stats.error("timeout")
            self._breaker.failure()
            raise
        except (BotoCoreError, OSError):
            self._stats.error("io")
            self._breaker.failure()
            raise
        self._breaker.success()
        return out

    # -- L3Store ------------------------------------------------------------------------
    def _contains(self, hashes: list[int]) -> list[bool]:
        return self._parallel(self._head_one, [(h,) for h in hashes])

    def _head_one(self, h: int) -> bool:
        try:
            return self._call(self._s3.head_object, Bucket=self.bucket, Key=self._key(h)) is not None
        except (_Unavailable, ClientError, BotoCoreError, OSError):
            return False

    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        return self._parallel(self._get_one, list(zip(ids, outs)), deadline)

    def _get_one(self, bid: BlockId, out: memoryview) -> bool:
        key = self._key(bid.hash)
        try:
            resp = self._call(self._s3.get_object, Bucket=self.bucket, Key=key)
            if resp is None:
                return False
            body = self._call(resp["Body"].read)  # the body streams: its read can time out too
        except (_Unavailable, ClientError, BotoCoreError, OSError):
            return False
        try:
            decode_into(self.layout, bid, body, out)
        except DecodeError as err:
            log.warning("s3 L3 %s: dropping %s (%s)", self.url, key_hex(bid.hash), err)
            self._stats.error(err.kind)
            try:
                self._s3.delete_object(Bucket=self.bucket, Key=key)  # would fail every reader
            except (ClientError, BotoCoreError):
                pass
            return False
        return True

    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        return self._parallel(self._put_one, list(zip(ids, payloads)))

    def _put_one(self, bid: BlockId, payload: memoryview) -> bool:
        try:
            self._call(self._s3.put_object, Bucket=self.bucket, Key=self._key(bid.hash),
                       Body=encode(self.layout, bid, payload))
        except (_Unavailable, ClientError, BotoCoreError, OSError) as err:
            if not isinstance(err, _Unavailable):
                log.warning("s3 L3 %s: put of %s failed: %s", self.url, key_hex(bid.hash), err)
            return False
        return True

    def _close(self) -> None:
        self._s3.close()
