"""`tierkv-serve`: the command line of the OpenAI-compatible server.

With no argument it serves the bundled SmolLM2-135M-Instruct on 127.0.0.1:8000. Options come
from flags, then a --config YAML file with the same keys, then defaults. SIGTERM/SIGINT drain
(no new requests, a grace period for running ones, write-back blocks flushed to L3) and exit 0.
Secrets (the API key, passwords in L3 URLs) are redacted from every log line and never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

from ..config import parse_size, redact_url
from ..engine.config import L2_DEFAULT_RULE, EngineConfig
from ..errors import ConfigError
from .kv_events import KVEventPublisher, KVEventsConfig
from .protocol import LOAD_FORMATS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "TIERKV_API_KEY"
# uvicorn waits this much longer than the grace period, so that streams cut at the end of the grace
# period can still send their last event before uvicorn cancels what is left
SHUTDOWN_SLACK_S = 5.0

# The engine's options and their defaults come from EngineConfig (one place); these are the server's own.
SERVER_OPTIONS = {
    "served_model_name": None, "host": DEFAULT_HOST, "port": DEFAULT_PORT, "api_key": None, "max_waiting": 256,
    "grace_period": 30.0, "flush_timeout": 60.0, "log_level": "info",
    # what one client may make the server hold (tierkv/server/limits.py); None: derived from max_model_len
    "max_request_bytes": None, "header_timeout": 10.0, "body_timeout": 30.0, "send_timeout": 30.0,
    "send_buffer_bytes": "256KiB", "keep_alive_timeout": 5.0, "max_connections": 1000, "max_keep_alive_requests": 1000,
    "kv_events_config": None, "strict_request_fields": False, "load_format": "vllm", "profile_dir": None,
}
TIMEOUTS = ("header_timeout", "body_timeout", "send_timeout", "keep_alive_timeout")
COUNTS = ("max_connections", "max_keep_alive_requests", "max_waiting")
GRACES = ("grace_period", "flush_timeout")  # seconds, 0 allowed
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
FD_SLACK = 256  # file descriptors beyond the connections: model files, L3 files, sockets to Redis/S3
ENGINE_OPTIONS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "cache_dir"}
OPTIONS = {**ENGINE_OPTIONS, **SERVER_OPTIONS}
_CACHE_FIELD = re.compile(r"\bCacheConfig\.(\w+)")  # how the cache's errors name an option


def flag_of(name: str) -> str:
    """The flag that sets an option: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


def in_flags(message: str) -> str:
    """A configuration error as this command's user reads it: the CacheConfig fields it names
    (CacheConfig.l2) become the flags that set them (--l2). The config owns the rules and their
    words; this is only the translation."""
    return _CACHE_FIELD.sub(lambda m: flag_of(m.group(1)) if m.group(1) in ENGINE_OPTIONS else m.group(0), message)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierkv-serve",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics, /v1/cache/stats) over tierkv's three-tier KV cache. With no argument: the bundled "
                    "SmolLM2-135M-Instruct on http://127.0.0.1:8000.",
        argument_default=argparse.SUPPRESS,  # unset flags fall through to --config, then defaults
    )
    a = p.add_argument
    a("--config", metavar="FILE.yaml", help="YAML file with any of these options as keys (dashes or underscores); "
      "flags given on the command line win")
    a("--model", help="a Hugging Face model directory, or a hub id (org/name; safetensors only, fetched into "
      "the HF cache; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE apply); default: the bundled SmolLM2-135M-Instruct")
    a("--served-model-name", help="the name clients put in 'model' (default: the hub id, the model directory's "
      "name, or HuggingFaceTB/SmolLM2-135M-Instruct, its hub id, for the bundled model)")
    a("--host", help=f"address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 for every interface)")
    a("--port", type=int, help=f"TCP port (default {DEFAULT_PORT})")
    a("--api-key", help=f"require 'Authorization: Bearer KEY' on every /v1 route (also read from ${API_KEY_ENV}); "
      "/health and /metrics stay open")
    a("--l1", help="bytes of the L1 pool on the device, e.g. 8GiB (default: 80%% of free GPU memory, 1GiB on CPU)")
    a("--l2", help="bytes of the pinned host L2 pool, e.g. 64GiB; 0 disables L2 (default: on a GPU "
      f"{L2_DEFAULT_RULE.replace('%', '%%')}; off on CPU)")
    a("--l3", action="append", metavar="URL", help="an L3 store, repeatable: file:///path?size=500GiB, "
      "redis://host:port/db, s3://bucket/prefix?endpoint=...")
    a("--eviction", help="eviction policy: lru, lfu, s3fifo, arc, priority (default lru)")
    a("--write-policy", help="when blocks are copied down a tier: write_through, write_back, selective "
      "(default: write_through with an --l3, write_back without; write_back blocks are flushed to L3 on shutdown)")
    a("--kv-offload-dtype", help="store L2 and L3 blocks as fp8_e4m3 (per-head scales, converted on the GPU as "
      "blocks move): ~2x the blocks in the same L2/L3, half the PCIe and disk bytes; L1 keeps the model's dtype "
      "(default: the model's dtype)")
    a("--block-size", type=int, help="tokens per KV block (default 16)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
      help="reuse cached KV across requests (default on); --no-enable-prefix-caching makes every lookup a miss "
      "(vLLM's name; a baseline for benchmarks)")
    a("--max-model-len", type=int, help="context length in tokens (default: the model's)")
    a("--max-num-batched-tokens", type=int, help="token budget of one step (default 8192 on GPU, 1024 on CPU)")
    a("--max-num-seqs", type=int, help="requests running at once (default 256)")
    a("--max-waiting", type=int, help="requests that may wait for admission; past it, 429 with Retry-After "
      "(default 256)")
    a("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
    a("--dtype", help="auto, bfloat16, float16, float32 (default auto: bf16 on GPU, fp32 on CPU)")
    a("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (faster start, slower decode)")
    a("--async-scheduling", action=argparse.BooleanOptionalAction,
      help="prepare the next step on the host while the GPU runs this one (default on); "
      "--no-async-scheduling runs each step to completion first")
    a("--tensor-parallel-size", "-tp", type=int, help="GPUs to split the model over, one process each, started by "
      "the server (rank r on cuda:r; pick GPUs with CUDA_VISIBLE_DEVICES); --l1/--l2 are then per GPU (default 1)")
    a("--grace-period", type=float, help="seconds running requests get to finish after SIGTERM; then each ends "
      "with an error event or a 503, whatever step the engine is in (default 30)")
    a("--flush-timeout", type=float, help="seconds allowed after the grace period for the step in flight to end and "
      "write-back blocks to be flushed to L3 (default 60)")
    a("--log-level", help="debug, info, warning, error, critical (default info)")
    a("--strict-request-fields", action="store_true", help="refuse (400, naming it) a request field the server does "
      "not take, instead of ignoring it and counting it in tierkv_request_unknown_fields_total; fields that would "
      "change the result are refused either way (default off: routers add fields of their own)")
    a("--load-format", choices=LOAD_FORMATS, help="the shape GET /get_load answers in: vllm ({\"load\": N}, "
      "vllm-router's power_of_two) or sglang ([{dp_rank, num_reqs, num_waiting_reqs, num_tokens}], sglang-router's); "
      "?format= overrides it per call (default vllm)")
    a("--kv-events-config", metavar="JSON", help="publish KV-cache events (blocks entering and leaving each tier, "
      "with their token ids) over ZMQ for cache-aware routers, as vLLM does and with its JSON, e.g. "
      "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
      "\"tcp://*:5558\"}'; '*' binds the --host address (default off)")
    a("--profile-dir", metavar="DIR", help="serve POST /start_profile and /stop_profile (vLLM's and SGLang's): a "
      "torch.profiler trace of the engine's steps, CPU and GPU, written to DIR as a gzipped Chrome trace (vLLM: "
      "VLLM_TORCH_PROFILER_DIR; default off)")
    g = p.add_argument_group("limits on clients", "what one client may make the server hold "
                             "(docs/serving.md, 'Limits'); the defaults are safe to expose behind a proxy")
    b = g.add_argument
    b("--max-request-bytes", help="largest request body, e.g. 4MiB; larger gets 413 (default: 64 bytes per "
      "token of --max-model-len, at least 1MiB)")
    b("--header-timeout", type=float, help="seconds a request's headers may take, from its first byte "
      "(or from the connection's opening); then 408 and close (default 10)")
    b("--body-timeout", type=float, help="seconds a request body may take after its headers; then 408 and close "
      "(default 30)")
    b("--send-timeout", type=float, help="seconds a response may wait on a client that stopped reading; then the "
      "connection is dropped and the request aborted (default 30)")
    b("--send-buffer-bytes", help="bytes queued for one client before a send waits (kernel socket buffer, and "
      "again in the server); a full buffer starts --send-timeout (default 256KiB)")
    b("--keep-alive-timeout", type=float, help="seconds an idle keep-alive connection stays open (default 5)")
    b("--max-connections", type=int, help="open connections; past it, new ones get 503 and are closed "
      "(default 1000)")
    b("--max-keep-alive-requests", type=int, help="requests on one connection before the server closes it "
      "(default 1000)")
    return p


def load_options(argv: list[str] | None = None) -> dict:
    """Flags, then the YAML file, then the environment (API key), then defaults."""
    p = parser()
    args = vars(p.parse_args(argv))
    merged = dict(OPTIONS)
    path = args.pop("config", None)
    if path is not None:
        merged.update(_read_yaml(p, path))
    merged.update(args)
    if merged["api_key"] is None and os.environ.get(API_KEY_ENV):
        merged["api_key"] = os.environ[API_KEY_ENV]
    if isinstance(merged["l3"], str):
        merged["l3"] = [merged["l3"]]
    _check_server_options(p, merged)
    return merged


def _check_server_options(p: argparse.ArgumentParser, opts: dict) -> None:
    """The server's own options, whether they came from flags or YAML (which may hold strings),
    before anything is loaded; the engine's are EngineConfig's to check."""
    for name in ("max_request_bytes", "send_buffer_bytes"):
        flag = flag_of(name)
        if opts[name] is None:
            continue  # derived from max_model_len
        try:
            opts[name] = parse_size(opts[name], flag)
        except ConfigError as err:
            p.error(str(err))
        if opts[name] < 4096:
            p.error(f"{flag} must be at least 4KiB, got {opts[name]}")
    for name, kind in [*((n, float) for n in TIMEOUTS), *((n, int) for n in COUNTS)]:
        flag = flag_of(name)
        try:
            value = kind(opts[name])
        except (TypeError, ValueError):
            p.error(f"{flag} must be a number, got {opts[name]!r}")
        if not value > 0 or value == float("inf"):
            p.error(f"{flag} must be a positive number, got {opts[name]!r}")
        opts[name] = value
    for name in GRACES:
        try:
            opts[name] = float(opts[name])
        except (TypeError, ValueError):
            opts[name] = -1.0
        if not 0 <= opts[name] < float("inf"):
            p.error(f"{flag_of(name)} must be a number of seconds >= 0, got {opts[name]!r}")
    if opts["load_format"] not in LOAD_FORMATS:
        p.error(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {opts['load_format']!r}")
    if not isinstance(opts["strict_request_fields"], bool):
        p.error(f"--strict-request-fields takes no value (YAML: true or false), got {opts['strict_request_fields']!r}")
    if str(opts["log_level"]).lower() not in LOG_LEVELS:
        p.error(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {opts['log_level']!r}")
    if opts["kv_events_config"] is not None:
        try:
            opts["kv_events_config"] = KVEventsConfig.parse(opts["kv_events_config"])
        except ConfigError as err:
            p.error(str(err))
    if opts["profile_dir"] is not None:
        opts["profile_dir"] = Path(str(opts["profile_dir"])).expanduser()
        try:  # made now, so that an unwritable place fails before the model loads, not at /stop_profile
            opts["profile_dir"].mkdir(parents=True, exist_ok=True)
            probe = opts["profile_dir"] / f".tierkv-write-check-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as err:
            p.error(f"--profile-dir {opts['profile_dir']} is not a directory this server can write traces to: "
                    f"{err.strerror or err}; give another one")
    port = opts["port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        p.error(f"--port must be an int from 0 to 65535, got {port!r}")


def _check_bind(host: str, port: int) -> None:
    """Bind the address once now, as uvicorn will (SO_REUSEADDR), so that a wrong --host or a busy
    --port fails before the model loads rather than after."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as err:
        raise ConfigError(f"cannot listen on --host {host} --port {port}: {err.strerror or err}") from None


def _raise_fd_limit(max_connections: int, log: logging.Logger) -> None:
    """Each connection is a file descriptor: raise the soft limit so that the cap, not EMFILE, is
    what a flood of connections meets."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_SLACK
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            log.warning("--max-connections %d needs %d file descriptors but the hard limit is %d (ulimit -Hn): "
                        "lower --max-connections or raise the limit", max_connections, need, hard)


def _read_yaml(p: argparse.ArgumentParser, path: str) -> dict:
    try:
        import yaml
    except ImportError:
        p.error("--config needs PyYAML: pip install pyyaml")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as err:
        p.error(f"cannot read --config {path}: {err}")
    if not isinstance(data, dict):
        p.error(f"--config {path} must hold a mapping of option: value")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in OPTIONS:
            p.error(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(sorted(OPTIONS))}")
        out[name] = value
    return out


class Redact(logging.Filter):
    """Masks the API key and the password part of URLs (scheme://user:secret@host) in log records."""

    URL_SECRET = re.compile(r"(\w+://[^/\s:@]*:)[^@\s/]+@")

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def scrub(self, text: str) -> str:
        text = self.URL_SECRET.sub(r"\1***@", text)
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = self.scrub(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


def _setup_logging(level: str, secrets: list[str]) -> Redact:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact = Redact(secrets)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(redact)
    return redact


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def tier_summary(engine) -> str:
    """The startup line on the tiers, from what the engine resolved (defaults filled in)."""
    from ..groups import KVGroups  # (here: the flags are checked before torch is imported)

    c, layout, cfg = engine.cache, engine.cache.layout, engine.config
    tiers = c.stats()["tiers"]  # (bytes from there: a cache per layer group has blocks of several sizes)
    groups = f", {len(c.caches)} layer groups" if isinstance(c, KVGroups) else ""
    l1 = f"L1 {c.l1.num_blocks} blocks ({_fmt_bytes(tiers['l1']['capacity_bytes'])}, {engine.lm.device}{groups})"
    fp8 = f", {cfg.kv_offload_dtype}" if cfg.kv_offload_dtype else ""
    l2 = (f"L2 {c.l2.num_blocks} blocks ({_fmt_bytes(tiers['l2']['capacity_bytes'])} "
          f"{'pinned' if c.l2.pinned else 'pageable'} host{fp8}){engine.l2_note}"
          if c.l2 is not None else "L2 off")
    l3s = "L3 " + (", ".join(redact_url(u) for u in cfg.l3) if cfg.l3 else "off")
    caching = "" if cfg.enable_prefix_caching else ", prefix caching off"
    tp = f", tensor parallel over {cfg.tensor_parallel_size} ranks (L1/L2 per rank)" if cfg.tensor_parallel_size > 1 else ""
    return (f"tiers: {l1} | {l2} | {l3s} | {cfg.eviction}, {cfg.write_policy}, "
            f"block {layout.block_size} tokens, context {engine.max_model_len}{caching}{tp}")


def describe(engine, opts: dict):
    """What the server serves (worker_routes.Served), as clients and routers are told. The bundled
    model is served under its hub id, so that clients find its tokenizer there; its files (and any
    model's) are also in `root`, the directory it was loaded from."""
    from ..engine.loader import BUNDLED_HUB_ID
    from .worker_routes import Served

    model = opts["model"]
    local = model is not None and Path(model).expanduser().is_dir()
    path = BUNDLED_HUB_ID if model is None else str(Path(model).expanduser().resolve()) if local else model
    name = opts["served_model_name"] or (Path(path).name if local else path)
    cache, cfg = engine.cache, engine.config
    return Served(
        name=name, max_model_len=engine.max_model_len, model_path=path,
        root=str(engine.lm.model_dir) if engine.tokenizer is not None else None, max_num_seqs=cfg.max_num_seqs,
        tensor_parallel_size=cfg.tensor_parallel_size,
        cache_config={"block_size": cache.layout.block_size, "num_gpu_blocks": cache.l1.num_blocks,
                      "num_cpu_blocks": cache.l2.num_blocks if cache.l2 is not None else 0,
                      "enable_prefix_caching": cfg.enable_prefix_caching,
                      "cache_dtype": str(cache.layout.dtype).removeprefix("torch.")})


def main(argv: list[str] | None = None) -> int:
    """Check the options, load the model and serve until SIGTERM or SIGINT; then the process exits
    (0). Returns only when the server could not start: 2 for a bad option, 1 for the rest."""
    opts = load_options(argv)
    # Every option is checked here, before torch, FastAPI or a weight is loaded: a bad value
    # fails in a fraction of a second (this file and EngineConfig import neither).
    try:
        config = EngineConfig(**{name: opts[name] for name in ENGINE_OPTIONS})
        _check_bind(str(opts["host"]), opts["port"])
    except ConfigError as err:
        print(f"tierkv-serve: {in_flags(Redact([]).scrub(str(err)))}", file=sys.stderr)
        return 2
    _setup_logging(opts["log_level"], [opts["api_key"]] if opts["api_key"] else [])
    log = logging.getLogger("tierkv.serve")
    kv_events = None  # bound before the model loads, so a busy port fails in a second
    if opts["kv_events_config"] is not None and opts["kv_events_config"].enabled:
        try:
            kv_events = KVEventPublisher(opts["kv_events_config"], host=str(opts["host"]), block_size=config.block_size)
        except ConfigError as err:
            print(f"tierkv-serve: {err}", file=sys.stderr)
            return 2
    try:
        import uvicorn

        from .app import create_app
        from .async_engine import AsyncEngine
        from .limits import Limits, protocol
    except ImportError as err:
        print(f"tierkv-serve needs the serve extra: pip install 'tierkv[serve]' ({err.name} is missing)",
              file=sys.stderr)
        return 2
    from ..engine.engine import Engine
    from ..errors import TierKVError

    try:
        engine = Engine(config=config)
    except TierKVError as err:
        print(f"tierkv-serve: {in_flags(Redact([]).scrub(str(err)))}", file=sys.stderr)
        return 2
    if kv_events is not None:
        engine.cache.listen(kv_events.events)
        if not config.enable_prefix_caching:
            log.warning("KV-cache events are on but prefix caching is off: routers will count on blocks that no "
                        "request reuses; drop --no-enable-prefix-caching")
    served = describe(engine, opts)
    name = served.name
    aengine = AsyncEngine(engine, max_waiting=opts["max_waiting"])
    app = create_app(aengine, served, api_key=opts["api_key"], grace_s=opts["grace_period"],
                     flush_timeout_s=opts["flush_timeout"], max_request_bytes=opts["max_request_bytes"],
                     kv_events=kv_events, strict_request_fields=opts["strict_request_fields"],
                     load_format=opts["load_format"], profile_dir=opts["profile_dir"])
    limits = Limits(**{f.name: opts[f.name] for f in dataclasses.fields(Limits) if f.name != "max_request_bytes"},
                    max_request_bytes=app.state.max_request_bytes)
    metrics = app.state.metrics
    _raise_fd_limit(limits.max_connections, log)
    # ws="none": no WebSocket route exists, so no upgrade path is offered either
    config = uvicorn.Config(app, host=opts["host"], port=opts["port"], log_level=opts["log_level"].lower(),
                            timeout_graceful_shutdown=opts["grace_period"] + SHUTDOWN_SLACK_S, log_config=None,
                            http=protocol(limits, lambda reason: metrics.closed.labels(reason).inc()), ws="none",
                            timeout_keep_alive=limits.keep_alive_timeout)
    server = _draining_server(config, aengine)
    metrics.open_connections.set_function(lambda: len(server.server_state.connections))
    print(f"tierkv-serve: {name} on http://{opts['host']}:{opts['port']}/v1"
          f"{' (API key required)' if opts['api_key'] else ''}", flush=True)
    print(f"tierkv-serve: {tier_summary(engine)}", flush=True)
    print(f"tierkv-serve: limits: body {_fmt_bytes(limits.max_request_bytes)}, headers {limits.header_timeout:g} s, "
          f"body {limits.body_timeout:g} s, stalled send {limits.send_timeout:g} s "
          f"({_fmt_bytes(limits.send_buffer_bytes)} buffer), keep-alive "
          f"{limits.keep_alive_timeout:g} s x {limits.max_keep_alive_requests} requests, "
          f"{limits.max_connections} connections", flush=True)
    # What the model load left is never garbage: out of the collector's sight, its full passes (which
    # hold the GIL, and so hold up the engine thread) stay short
    gc.collect()
    gc.freeze()
    server.run()
    if kv_events is not None:
        kv_events.close()  # after the engine's shutdown: its last evictions go out too
    if not server.started:
        log.error("the server did not start (is port %s free?)", opts["port"])
        return 1
    log.info("stopped")
    # Exit now, without finalizing the interpreter: the engine is closed and its write-back blocks
    # flushed, or it was left in a step longer than --flush-timeout, under which finalizing would
    # tear libtorch down (std::terminate, SIGABRT); collecting a loaded model's heap took 2-15 s
    # after this line, past the grace period a supervisor allows. Tensor-parallel ranks exit with
    # this process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _draining_server(config, engine):
    """uvicorn's server, but a signal means drain and exit 0 (uvicorn re-raises the signal after a
    graceful shutdown, which would end the process with -SIGTERM). Made when the server starts, so
    that importing this file (to check options) does not import uvicorn."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, engine) -> None:
            super().__init__(config)
            self.engine = engine
            self.grace_s = config.timeout_graceful_shutdown - SHUTDOWN_SLACK_S

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        def _on_signal(self, sig, frame) -> None:
            self.engine.drain(self.grace_s)  # refuse new requests at once; uvicorn closes the listener next
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server(config, engine)


if __name__ == "__main__":
    sys.exit(main())
