"""Request: one generation in flight, from admission to its last token; and what callers get back.

A request owns its token ids, sampling state and (while running) its L1 blocks. It holds no
logic beyond bookkeeping: the scheduler decides what runs, the runner computes, the engine
applies the results. Never imports the server.

With n > 1 (parallel sampling) one request is n `Request`s, one per choice, sharing a request
id: choice 0 is queued and computes the prompt; choices 1..n-1 wait in its `forks` until its
prefill samples, then take its prompt blocks (`TieredKVCache.fork`) and run on their own.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..cache import Prefetch, SequenceBlocks
from .sampler import SamplingParams
from .tokenizer import IncrementalDetokenizer

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its blocks given back)
    RUNNING = "running"  # holds L1 blocks and is scheduled every step
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    priority: int = 0  # higher runs first and is preempted last
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    # Sampled tokens still on their way from the GPU (0 or 1): with overlap the next step is
    # scheduled before this one's token reaches the host, and reads it from the GPU directly.
    pending: int = 0
    status: Status = Status.WAITING
    seq: SequenceBlocks | None = None  # its L1 blocks while running
    num_computed: int = 0  # leading tokens whose KV is in its L1 blocks
    cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    cached_by_tier: dict[str, int] | None = None  # those tokens by the tier each came from (l1, l2, l3)
    prefetch: Prefetch | None = None  # L3 blocks on their way into L2 before admission
    prefetch_until: float = 0.0
    refused_at_room: int | None = None  # L1's room when admission last found it did not fit (cache.l1_room())
    l2_left: int | None = None  # its plan's tokens still in L2 after the last slice warmed for it (Scheduler)
    tail: Prefetch | None = None  # the end of its L3 hit, read into L2 while the start is computed
    adopt_at: int | None = None  # prompt position where that tail is taken
    tail_tokens: int = 0  # the tokens taking that tail saves computing (it waits no longer than they take)
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # the output's text so far (cut at a stop string)
    sent: int = 0  # characters of `text` handed out (take_text)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    admitted: float | None = None  # when it first got L1 blocks (its prefill began)
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its latest token came back (inter-token latency)
    finish_time: float | None = None
    index: int = 0  # which choice of its request (n > 1)
    group: list[Request] | None = None  # every choice of its request, in index order (n > 1 only)
    forks: list[Request] = field(default_factory=list)  # choices waiting for this one's prefill

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output ids the host knows (a pending token is not among them)."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Known token ids [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host holds: the prompt and the output that came back."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, counting a sampled token still on its way."""
        return self.num_known + self.pending

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def take_text(self) -> str:
        """The text not handed out yet: once finished, all of it; before, all but the tail that a
        stop string completed by later tokens could still cut (SamplingParams.stop_buffer_length),
        so that a stream never sends text the answer does not keep."""
        end = len(self.text) if self.finished else len(self.text) - self.params.stop_buffer_length
        if end <= self.sent:
            return ""
        new, self.sent = self.text[self.sent : end], end
        return new

    @property
    def choices(self) -> list[Request]:
        """Every choice of this request (itself alone when n is 1)."""
        return self.group if self.group is not None else [self]


@dataclass(slots=True)
class RequestOutput:
    """What `LLM.generate` returns and the server streams: the state of one request.

    The engine's outputs are per choice (`index`; all of them under one request_id), and
    `request_finished` says that every choice of the request has finished. `LLM.generate`
    returns one per prompt: with n > 1 its top-level fields are choice 0's and `outputs` lists
    all n choices in index order, as vLLM's RequestOutput.outputs does (with n = 1, `outputs`
    is [itself]).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cached_tokens: int
    finish_reason: str | None
    cached_by_tier: dict[str, int] | None = None  # cached_tokens by the tier each came from (l1, l2, l3)
    logprobs: list[dict] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # since the previous step
    new_text: str = ""
    index: int = 0  # which choice (n > 1)
    request_finished: bool = False  # every choice of the request has finished
    choices: list[RequestOutput] | None = field(default=None, repr=False)  # all n, from LLM.generate

    @property
    def finished(self) -> bool:
        """This choice has finished."""
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[RequestOutput]:
        """The request's choices in index order (vLLM's shape): [itself] when n is 1."""
        return self.choices if self.choices is not None else [self]
