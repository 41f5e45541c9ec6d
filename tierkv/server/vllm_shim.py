"""`vllm serve` for tierkv's image: vLLM's command line mapped onto tierkv-serve's.

Charts that start an engine as `vllm serve MODEL --host H --port P <extra args>` (the vLLM
production-stack chart) run tierkv-serve through this (the image links `vllm` to it). A flag
tierkv-serve has passes through unchanged; a vLLM flag that changes nothing here is dropped; any
other vLLM flag stops the start with a message naming it and what to use instead. It never
guesses a translation, never starts anything but tierkv-serve, and never prints a secret.
"""

from __future__ import annotations

import os
import shlex
import sys

from ..engine.config import EngineConfig
from ..errors import TierKVError
from . import cli

# vLLM flags that tierkv-serve accepts and ignores, and why ignoring them changes no result.
IGNORED = {
    "--enable-chunked-prefill": "tierkv always chunks prefill under --max-num-batched-tokens",
    "--disable-log-requests": "tierkv-serve never logs request contents",
    "--no-enable-log-requests": "tierkv-serve never logs request contents",
    "--disable-log-stats": "tierkv-serve logs no periodic stats (they are on /metrics)",
    "--trust-remote-code": "tierkv runs only the architectures it implements, never a model's own code",
}

# vLLM flags with no tierkv-serve meaning that a chart commonly sets: what to pass instead.
REFUSED = {
    "--gpu-memory-utilization": "tierkv sizes its GPU pool in bytes: pass --l1 SIZE (e.g. --l1 60GiB)",
    "--no-enable-chunked-prefill": "tierkv always chunks prefill; bound a step with --max-num-batched-tokens",
    "--swap-space": "tierkv keeps preempted and evicted blocks in L2: pass --l2 SIZE",
    "--cpu-offload-gb": "tierkv offloads KV, not weights, to host memory: pass --l2 SIZE",
    "--kv-transfer-config": "tierkv's own tiers replace a KV connector: pass --l2 SIZE and --l3 URL",
    "--revision": "serve a pinned revision from a local directory: --model /path/to/snapshot",
    "--enable-lora": "tierkv-serve serves no LoRA adapters",
    "--data-parallel-size": "run one replica per GPU behind a router instead (deploy/k8s)",
}

DRY_RUN = "--dry-run"
# production-stack sets these for vLLM: the API key under vLLM's name, and a prometheus_client
# multiprocess directory, which would switch tierkv's single-process metrics to mmap'd files.
API_KEY_ENV = "VLLM_API_KEY"
PROFILER_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM serves /start_profile and /stop_profile when it is set
DROPPED_ENV = ("PROMETHEUS_MULTIPROC_DIR",)

USAGE = f"""usage: vllm serve [MODEL] [tierkv-serve options] [{DRY_RUN}]

tierkv's stand-in for `vllm serve`: runs tierkv-serve with the same options.
MODEL (or --model) is a Hugging Face hub id or a model directory; none serves the bundled model.
Every tierkv-serve option passes through (`tierkv-serve --help` lists them). ${API_KEY_ENV}
stands in for ${cli.API_KEY_ENV}. {DRY_RUN} prints the tierkv-serve command after checking it,
and starts nothing.

vLLM flags accepted and ignored:
""" + "".join(f"  {flag:<28} {why}\n" for flag, why in IGNORED.items()) + """
vLLM flags refused, with what to pass instead:
""" + "".join(f"  {flag:<28} {what}\n" for flag, what in REFUSED.items())


class ShimError(ValueError):
    """A command line tierkv-serve cannot honour; the message says what to change."""


def translate(argv: list[str]) -> list[str]:
    """`vllm` arguments (after the program name) -> tierkv-serve arguments. Raises ShimError."""
    if not argv or argv[0] != "serve":
        raise ShimError(f"only `vllm serve` is provided by tierkv's image, got `vllm {shlex.join(argv)}`")
    known = cli.parser()._option_string_actions  # flag -> its argparse action
    out: list[str] = []
    model: str | None = None
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            if model is not None:
                raise ShimError(f"vllm serve takes one model, got {model!r} and {arg!r}")
            model = arg
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")  # vLLM accepts --max_model_len too
        if name in IGNORED:
            if eq:
                raise ShimError(f"{name} takes no value, got {arg!r}")
            continue
        if name in REFUSED:
            raise ShimError(f"{name} has no tierkv-serve equivalent: {REFUSED[name]}")
        if name not in known or name in ("-h", "--help", "--config"):
            raise ShimError(f"unknown option {name!r} for tierkv-serve (`tierkv-serve --help` lists its options; "
                            "vllm serve --help lists the vLLM flags this image maps)")
        if name == "--model":
            if model is not None:
                raise ShimError(f"the model is given twice: {model!r} and --model")
            if not eq and not rest:
                raise ShimError("--model needs a value")
            model = value if eq else rest.pop(0)
            continue
        out.append(name)
        if known[name].nargs != 0:  # store_true and --x/--no-x flags take none
            if eq:
                out.append(value)
            elif rest:
                out.append(rest.pop(0))
            else:
                raise ShimError(f"{name} needs a value")
        elif eq:
            raise ShimError(f"{name} takes no value, got {arg!r}")
    return (["--model", model] if model is not None else []) + out


def shown(args: list[str]) -> str:
    """The tierkv-serve command as a shell line, the API key masked."""
    masked = ["***" if i and args[i - 1] == "--api-key" else a for i, a in enumerate(args)]
    return shlex.join(["tierkv-serve", *masked])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or "-h" in argv or "--help" in argv:
        print(USAGE, end="")
        return 0
    dry = DRY_RUN in argv
    try:
        args = translate([a for a in argv if a != DRY_RUN])
    except ShimError as err:
        print(f"vllm (tierkv): {err}", file=sys.stderr)
        return 2
    if os.environ.get(API_KEY_ENV) and not os.environ.get(cli.API_KEY_ENV):
        os.environ[cli.API_KEY_ENV] = os.environ[API_KEY_ENV]
    if os.environ.get(PROFILER_ENV) and "--profile-dir" not in args:
        args += ["--profile-dir", os.environ[PROFILER_ENV]]
    for name in DROPPED_ENV:
        os.environ.pop(name, None)
    if dry:
        # the checks tierkv-serve makes before loading anything (a bad value exits 2 there too)
        opts = cli.load_options(args)
        try:
            EngineConfig(**{name: opts[name] for name in cli.ENGINE_OPTIONS})
        except TierKVError as err:
            print(f"vllm (tierkv): {cli.Redact([]).scrub(str(err))}", file=sys.stderr)
            return 2
        print(shown(args))
        return 0
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
