"""s3: the S3 L3 store (`s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1`).

One object per chunk (chunks.py), `<prefix>/<32 hex>.c<K>`, body = its codec records. A lookup
probes (chunks.probe_prefix): HEADs of the first and the last chunk in parallel, so a whole hit or
miss is one round trip, and a run that ends inside takes up to three more; a read is one ranged
GET per chunk, a write one PUT; they run in parallel on a thread pool. Connect/read timeouts bound
every call, a failed call is retried (`retries` attempts in all) and a short back-off skips calls
while the service is down. The defaults are a cache's, not botocore's (60 s timeouts, 3 attempts):
`timeout=2` (seconds without a byte from the service: a large PUT or GET streams, so it bounds a
stall, not a transfer), `connect_timeout=1`, `retries=2`. A miss costs a recompute, while a worker
stuck on a hung service holds up the reads or writes queued behind it (the engine waits for
neither: lookups have their own timeout, l3.py). tierkv had 10 s and 3 attempts (4 for botocore,
whose max_attempts counts retries only): one lookup of a hung S3 took ~30 s, on the engine's thread.
Credentials come from boto3's usual chain (env vars, ~/.aws files, instance roles) and are never
logged; logged URLs are redacted.
Options: create_bucket=1, threads, timeout, connect_timeout, retries, addressing=path|virtual|auto,
chunk (tokens per object), lookup_timeout (l3.py). Objects of the one-block format 1
(`<prefix>/<32 hex>`) are never read.

HEADs skip botocore's per-call machinery (_Heads). A lookup's time on loopback was its HEAD count
times the ~1-2 ms of CPU botocore spends on each (validation, endpoint rules, event hooks,
parsing), under the GIL, so parallel HEADs gained nothing. So at open botocore is asked once how
it sends a HEAD under the prefix (a handler captures the signed request before it leaves: the URL
with its addressing style, the signing region), and each HEAD is then signed with botocore's
SigV4 signer and the session's credentials (refreshed as botocore refreshes them) and sent on a
keep-alive urllib3 pool with the same timeouts and attempts: a third of the CPU. 64-block lookups
on loopback SeaweedFS, 2-vCPU VM, median of bench_tiers runs: all stored 3.6 -> 2.1 ms, none
2.9 -> 1.8 ms, the first 37 (with 3 probes a round, chunks.py) 21.8 -> 9.0 ms. Where the copy could
differ from botocore (a proxy, a client certificate, no credentials, a signer other than SigV4 for
s3, a bucket answering from another region) HEADs stay on botocore. GET/PUT/DELETE stay on boto3:
their bytes dominate, and it handles streaming, payload signing and error parsing.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote, unquote, urlsplit
from urllib.request import getproxies, proxy_bypass

import boto3
import botocore.session
import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError
from botocore.httpsession import get_cert_path
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from ..errors import ConfigError
from ..layout import KVLayout
from .chunks import DEFAULT_CHUNK_TOKENS
from .l3 import COMMON_OPTIONS, L3Store
from .service import Breaker, UrlOptions

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_PAST_END = {"416", "InvalidRange"}  # a ranged GET that starts beyond the object's end
_ADDRESSING = ("auto", "path", "virtual")
# Timeouts and attempts (why these: the module docstring)
DEFAULT_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_ATTEMPTS = 2.0, 1.0, 2
_MARKER = "tierkv-head-template"  # the key botocore is asked to build a HEAD for (never sent)
# "AWS4-HMAC-SHA256 Credential=<key id>/<date>/<region>/<service>/aws4_request, ..."
_SCOPE = re.compile(r"AWS4-HMAC-SHA256 Credential=[^/,]+/\d{8}/([^/,]+)/([^/,]+)/aws4_request")


class _Unavailable(Exception):
    pass


class _Status(Exception):
    """A HEAD answered with neither 200 nor 404 (denied, 5xx after the retries)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _Moved(Exception):
    """The bucket answers from another region than the one the HEADs are signed for."""

    def __init__(self, region: str | None) -> None:
        super().__init__(f"bucket is in region {region}")
        self.region = region


class _Captured(Exception):
    def __init__(self, request) -> None:
        super().__init__("captured")
        self.request = request


class _Heads:
    """HEAD requests sent as botocore sends them, without its per-call pipeline.

    `base` is botocore's URL of a key under the prefix, less that key's name; `region` the
    region botocore signs for. size() raises what _call classifies (_Status, urllib3 errors).
    """

    def __init__(self, base: str, region: str, credentials, config: Config, attempts: int,
                 ca_bundle: str | None) -> None:
        self.base, self.region, self._credentials = base, region, credentials
        self._path = urlsplit(base).path
        # What botocore's standard mode retries (connection errors, timeouts, 5xx), as many times;
        # a shorter back-off, since a lookup is a hint that a miss answers well enough.
        retries = urllib3.Retry(total=attempts - 1, status_forcelist=(500, 502, 503, 504), raise_on_status=False,
                                backoff_factor=0.05, respect_retry_after_header=False)
        tls = {}
        if base.startswith("https:"):  # verified against the CA bundle botocore would use
            tls = {"cert_reqs": "CERT_REQUIRED", "ca_certs": get_cert_path(ca_bundle or True)}
        self._pool = urllib3.connection_from_url(
            base, maxsize=config.max_pool_connections, block=False, retries=retries,
            timeout=urllib3.Timeout(connect=config.connect_timeout, read=config.read_timeout), **tls)

    def size(self, name: str) -> int | None:
        """The object's size in bytes, None if it does not exist."""
        key = quote(name, safe="/~")  # as botocore quotes a key
        request = AWSRequest(method="HEAD", url=self.base + key)
        # get_frozen_credentials refreshes temporary credentials when due, as botocore does per call
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self.region).add_auth(request)
        try:
            resp = self._pool.urlopen("HEAD", self._path + key, headers=dict(request.headers.items()),
                                      redirect=False, preload_content=True)
        except MaxRetryError as err:  # the retries ran out: classify what failed last
            raise err.reason or err from None
        if resp.status == 200 and "content-length" in resp.headers:
            return int(resp.headers["content-length"])
        if resp.status == 404:
            return None
        moved = resp.headers.get("x-amz-bucket-region")
        if resp.status in (301, 307) or (moved and moved != self.region):
            raise _Moved(moved)
        raise _Status(resp.status)

    def close(self) -> None:
        self._pool.close()


class S3Store(L3Store):
    name = "s3"
    shared = True
    probe_lookup = True  # a HEAD costs a round trip: probe for the end of the run (chunks.probe_prefix)

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("endpoint", "region", "create_bucket", "threads", "timeout",
                                "connect_timeout", "retries", "addressing", "chunk", *COMMON_OPTIONS))
        threads = opts.get("threads", 16, int)
        endpoint = opts.get("endpoint", None, str)
        # Self-hosted S3 (SeaweedFS, MinIO) on an IP endpoint needs path-style addressing.
        addressing = opts.get("addressing", "path" if endpoint else "auto", str)
        timeout = opts.get("timeout", DEFAULT_TIMEOUT_S, float)
        connect_timeout = opts.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S, float)
        attempts = opts.get("retries", DEFAULT_ATTEMPTS, int)
        where = f"s3 L3 URL {opts.url}"
        if threads < 1 or attempts < 1 or not timeout > 0 or not connect_timeout > 0:
            raise ConfigError(f"{where}: threads and retries must be at least 1, timeout and connect_timeout above 0")
        if addressing not in _ADDRESSING:
            raise ConfigError(f"{where}: addressing={addressing!r}; accepted: {', '.join(_ADDRESSING)}")
        if endpoint is not None and not re.match(r"https?://[^/?#]", endpoint):
            raise ConfigError(f"{where}: endpoint {endpoint!r} is not an http(s) URL; use endpoint=http://host:port")
        super().__init__(layout, url, threads, opts.get("chunk", DEFAULT_CHUNK_TOKENS, int), opts)
        parts = urlsplit(url)
        self.bucket = parts.netloc
        self.prefix = unquote(parts.path).strip("/")
        self._config = Config(
            connect_timeout=connect_timeout, read_timeout=timeout,
            # total_max_attempts counts the first attempt; botocore's max_attempts does not (3 made 4)
            retries={"total_max_attempts": attempts, "mode": "standard"},
            max_pool_connections=threads,
            s3={"addressing_style": addressing},
        )
        self._core = botocore.session.get_session()  # its own: credentials and ca_bundle are read from it
        self._s3 = boto3.session.Session(botocore_session=self._core).client(
            "s3", endpoint_url=endpoint, region_name=opts.get("region", None, str), config=self._config
        )
        self._breaker = Breaker(health=self.health, part="the service")
        self._heads = self._head_template(attempts)
        if opts.get("create_bucket", False, UrlOptions.boolean):
            self._create_bucket()

    def _head_template(self, attempts: int) -> _Heads | None:
        """The fast HEAD path (_Heads), from how botocore sends a HEAD under this prefix; None
        where HEADs must stay on botocore (see the module docstring)."""
        credentials = self._core.get_credentials()
        if credentials is None:
            return None  # botocore's own HEADs then fail, and are counted, as before

        def capture(request, **_):
            raise _Captured(request)

        events = self._s3.meta.events
        events.register_first("before-send.s3.HeadObject", capture, unique_id="tierkv-head-template")
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(_MARKER))
            return None  # not reached: the handler raises before anything is sent
        except _Captured as c:
            request = c.request
        except Exception as err:  # no region, a bucket name botocore refuses...: botocore decides
            log.info("s3 L3 %s: HEADs stay on botocore: %s", self.url, err)
            return None
        finally:
            events.unregister("before-send.s3.HeadObject", unique_id="tierkv-head-template")
        auth = request.headers.get("Authorization") or b""
        url, scope = request.url, _SCOPE.match(auth.decode("latin-1") if isinstance(auth, bytes) else auth)
        parts = urlsplit(url)
        proxied = getproxies().get(parts.scheme) and not proxy_bypass(parts.hostname or "")
        if proxied or self._config.proxies or self._config.client_cert:
            log.info("s3 L3 %s: HEADs stay on botocore: it sends them through a proxy or with a client certificate",
                     self.url)
            return None
        if scope is None or scope[2] != "s3" or parts.query or not url.endswith("/" + _MARKER):
            log.info("s3 L3 %s: HEADs stay on botocore: it signs them other than with SigV4 for s3", self.url)
            return None
        return _Heads(url[: -len(_MARKER)], scope[1], credentials, self._config, attempts,
                      self._core.get_config_variable("ca_bundle"))

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
        except _Status:
            self._stats.error("io")  # the same, from the fast HEAD path
            raise
        except NewConnectionError as err:  # refused or unresolvable: urllib3 files it under connect timeouts
            self._stats.error("io")
            self._breaker.failure(err)
            raise
        except (ConnectTimeoutError, ReadTimeoutError, Urllib3Timeout) as err:
            self._stats.error("timeout")
            self._breaker.failure(err)
            raise
        except (BotoCoreError, OSError, Urllib3Error) as err:
            self._stats.error("io")
            self._breaker.failure(err)
            raise
        self._breaker.success()
        return out

    # -- chunked L3Store backend ---------------------------------------------------------
    def _stat(self, names: list[str]) -> list[int | None]:
        return self._map(self._head_one, [(n,) for n in names], None)

    def _head_one(self, name: str) -> int | None:
        heads = self._heads
        try:
            if heads is not None:
                return self._call(heads.size, name)
            resp = self._call(self._s3.head_object, Bucket=self.bucket, Key=self._key(name))
        except _Moved as err:
            # botocore follows the bucket to its region; the fast path would only keep failing
            if self._heads is heads:
                self._heads = None
                log.warning("s3 L3 %s: bucket %s answers from region %s, not %s: HEADs go through botocore now; "
                            "set region= in the URL for faster lookups", self.url, self.bucket,
                            err.region or "(not said)", heads.region)
            return self._head_one(name)
        except (_Unavailable, _Status, ClientError, BotoCoreError, OSError, Urllib3Error):
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
                self._warn("s3 L3 %s: put of %s failed: %s", self.url, name, err)
            return False
        return True

    def _delete(self, name: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    def _close(self) -> None:
        if self._heads is not None:
            self._heads.close()
        self._s3.close()
