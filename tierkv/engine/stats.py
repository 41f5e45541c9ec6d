"""EngineStats: what the engine counts per step and per request, for the server's /metrics.

The step-level and request-level series vLLM exports besides the cache's own counters: tokens
per step, the gap between one request's tokens, and each finished request's time waiting for
admission, computing its prompt and decoding, and its prompt length. Fixed-bucket histograms with
vLLM's buckets, updated on the engine thread without allocating; `snapshot()` copies them for
another thread. And where the engine thread's time goes, which vLLM does not export: steps
launched (decode-only or with prompt tokens) and how many requests each ran, host seconds per phase of
a step, the time spent in steps that launched nothing while requests were unfinished (the GPU had
none of this engine's work: loads landing, L1 room, L3 reads), and the GPU's seconds on the steps
by kind (CUDA events; against the wall time, what the GPU idled), with those of the steps that
were launched while loads into their requests' blocks were in flight (they may have waited for
them on the GPU). Knows nothing of Prometheus or HTTP.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import ScheduledStep

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards and SLO queries written for
# vLLM read the same resolution here.
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTER_TOKEN_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
# Requests in a launched step: every size up to 8 (a batch of 4 against 5 is what waves look
# like), then coarser up to the largest max_num_seqs anyone sets
STEP_BATCH = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
REQUEST_PHASE_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts up to the context."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class Histogram:
    """Counts per bucket: `counts[i]` holds the values in (bounds[i-1], bounds[i]], the last one
    those above every bound (Prometheus' `le` buckets, not cumulated)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        return {"bounds": self.bounds, "counts": list(self.counts), "sum": self.sum}


class EngineStats:
    """The engine's histograms (see the module docstring). Preemptions are the scheduler's own
    count (Scheduler.num_preemptions), read into each snapshot."""

    def __init__(self, max_model_len: int) -> None:
        self.iteration_tokens = Histogram(ITERATION_TOKENS)  # prompts that got their first token + tokens sampled
        self.inter_token = Histogram(INTER_TOKEN_S)  # a request's token to its next one (each choice's own)
        self.queue = Histogram(REQUEST_PHASE_S)  # arrival at the engine to first admission
        self.prefill = Histogram(REQUEST_PHASE_S)  # first admission to first token (preemptions included)
        self.decode = Histogram(REQUEST_PHASE_S)  # first token to last token
        self.prompt_tokens = Histogram(one_two_five(max_model_len))
        # requests in each launched step, by kind: decode (every request one token) or mixed (some
        # compute prompt tokens); their counts are the steps, their sums the requests in them
        self.batch = {"decode": Histogram(STEP_BATCH), "mixed": Histogram(STEP_BATCH)}
        # engine-thread seconds: scheduling, launching (runner.run), waiting for a launched step's
        # tokens (blocked on the GPU: a host with time to spare), and the rest of a step (taking
        # those tokens back and handing them over)
        self.host_s = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "postprocess": 0.0}
        self.idle_steps, self.idle_s = 0, 0.0  # step() calls that launched nothing, with requests unfinished
        # each step's first kernel to its last copy on the GPU, waits for loads included (CUDA), by kind
        self.gpu_s = {"decode": 0.0, "mixed": 0.0}
        self.load_wait_steps, self.load_wait_gpu_s = 0, 0.0  # steps launched with loads in flight, their GPU seconds

    def stepped(self, launched: ScheduledStep | None, total_s: float, schedule_s: float, launch_s: float,
                taken_s: float, wait_s: float) -> None:
        """One step() call of `total_s` seconds that launched `launched` (None: nothing); `taken_s`
        of it taking a launched step's tokens back, `wait_s` of that blocked until the GPU had
        finished the step. A call that launched nothing was idle but for that (the GPU ran the
        step taken back meanwhile)."""
        if launched is not None:
            self.batch["decode" if launched.is_decode else "mixed"].observe(len(launched))
        else:
            self.idle_steps += 1
            self.idle_s += total_s - taken_s
        self.host_s["schedule"] += schedule_s
        self.host_s["launch"] += launch_s
        self.host_s["wait"] += wait_s
        self.host_s["postprocess"] += total_s - schedule_s - launch_s - wait_s

    def ran(self, decode: bool, gpu_s: float, loaded: bool) -> None:
        """A launched step's GPU seconds, once it is done: `decode` whether every request in it
        computed one token, `loaded` whether some of its requests' loads were still in flight."""
        self.gpu_s["decode" if decode else "mixed"] += gpu_s
        if loaded:
            self.load_wait_steps += 1
            self.load_wait_gpu_s += gpu_s

    def finished(self, choices: list) -> None:
        """A request ended with every choice done (stop or length): its phases, once per request as
        the server counts requests, from choice 0 (the one that computed the prompt) to the last
        token of any choice."""
        first = choices[0]
        if first.admitted is None or first.first_token_time is None:
            return  # it never ran (ended while waiting): no phase to time
        last = max(c.last_token_time for c in choices if c.last_token_time is not None)
        self.queue.observe(first.admitted - first.arrival)
        self.prefill.observe(first.first_token_time - first.admitted)
        self.decode.observe(last - first.first_token_time)
        self.prompt_tokens.observe(len(first.prompt_ids))

    def snapshot(self, num_preemptions: int) -> dict:
        return {"num_preemptions": num_preemptions, "iteration_tokens": self.iteration_tokens.snapshot(),
                "inter_token_latency": self.inter_token.snapshot(), "request_queue_time": self.queue.snapshot(),
                "request_prefill_time": self.prefill.snapshot(), "request_decode_time": self.decode.snapshot(),
                "request_prompt_tokens": self.prompt_tokens.snapshot(),
                "step_batch": {kind: h.snapshot() for kind, h in self.batch.items()},
                "steps": {kind: sum(h.counts) for kind, h in self.batch.items()},
                "step_requests": int(sum(h.sum for h in self.batch.values())), "host_seconds": dict(self.host_s),
                "idle_steps": self.idle_steps, "idle_seconds": self.idle_s, "gpu_seconds": dict(self.gpu_s),
                "load_wait_steps": self.load_wait_steps, "load_wait_gpu_seconds": self.load_wait_gpu_s}
