"""s3: the S3 L3 store (`s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1`).

One object per chunk (l3.py), `<prefix>/<32 hex>.c<K>`, body = its codec records. A lookup
probes (l3.probe_prefix): HEADs of the first and the last chunk in parallel, so a whole hit or
miss is one round trip, and a run that ends inside a few more; a read is one ranged GET per
chunk, a write one PUT; they run in parallel on a thread pool. boto3's standard retry mode adds backoff; connect/read timeouts bound every call
and a short back-off skips calls while the service is down. Credentials come from boto3's usual
chain (env vars, ~/.aws files, instance roles) and are never logged; logged URLs are redacted.
Options: create_bucket=1, threads, timeout, connect_timeout, retries, addressing=path|virtual,
chunk (tokens per object). Objects of the one-block format 1 (`<prefix>/<32 hex>`) are never read.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

from ..layout import KVLayout
from .l3 import DEFAULT_CHUNK_TOKENS, L3Store
from .service import Breaker, UrlOptions

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_PAST_END = {"416", "InvalidRange"}  # a ranged GET that starts beyond the object's end


class _Unavailable(Exception):
    pass


class S3Store(L3Store):
    name = "s3"
    probe_lookup = True  # a HEAD costs a round trip: probe for the end of the run (l3.probe_prefix)

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("endpoint", "region", "create_bucket", "threads", "timeout",
                                "connect_timeout", "retries", "addressing", "chunk"))
        threads = opts.get("threads", 16, int)
        super().__init__(layout, url, threads, opts.get("chunk", DEFAULT_CHUNK_TOKENS, int))
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

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, fn, *args, **kwargs):
        """One request; None for a missing key (or a range past its end); classify failures for stats and the breaker."""
        if not self._breaker.allow():
            self._stats.error("unavailable")
            raise _Unavailable()
        try:
            out = fn(*args, **kwargs)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in _NOT_FOUND | _PAST_END:
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

    # -- chunked L3Store backend ---------------------------------------------------------
    def _stat(self, names: list[str]) -> list[int | None]:
        return self._map(self._head_one, [(n,) for n in names], None)

    def _head_one(self, name: str) -> int | None:
        try:
            resp = self._call(self._s3.head_object, Bucket=self.bucket, Key=self._key(name))
        except (_Unavailable, ClientError, BotoCoreError, OSError):
            return None
        return None if resp is None else int(resp["ContentLength"])

    def _read(self, name: str, offset: int, views: list[memoryview]) -> tuple[int, int] | None:
        want = sum(len(v) for v in views)
        try:
            resp = self._call(self._s3.get_object, Bucket=self.bucket, Key=self._key(name),
                              Range=f"bytes={offset}-{offset + want - 1}")
        except (_Unavailable, ClientError, BotoCoreError, OSError):
            return None
        if resp is None:  # no such object, or shorter than the records asked for
            return None
        try:
            body = self._call(resp["Body"].read)  # the body streams: its read can time out too
        except (_Unavailable, ClientError, BotoCoreError, OSError):
            return None
        # "bytes 0-99/1234": the object's full size follows the slash.
        size = int(str(resp.get("ContentRange", "")).rpartition("/")[2] or len(body) + offset)
        pos = 0
        for v in views:
            n = min(len(v), len(body) - pos)
            if n <= 0:
                break
            v[:n] = body[pos : pos + n]
            pos += n
        return size, pos

    def _write(self, name: str, parts: list, size: int) -> bool:
        try:
            self._call(self._s3.put_object, Bucket=self.bucket, Key=self._key(name), Body=b"".join(parts))
        except (_Unavailable, ClientError, BotoCoreError, OSError) as err:
            if not isinstance(err, _Unavailable):
                log.warning("s3 L3 %s: put of %s failed: %s", self.url, name, err)
            return False
        return True

    def _delete(self, name: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    def _close(self) -> None:
        self._s3.close()
