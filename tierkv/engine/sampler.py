"""Sampling: the per-request `SamplingParams`, and one batched step from logits to token ids.

The step runs on the logits' device with host-side decisions made from the params alone (which
processing any row needs), so it never forces a GPU sync itself. Per-request seeds get their
own torch.Generator, so a seeded request samples the same tokens whatever else is in the batch.
Stop conditions on ids and on text are small pure functions here; detokenizing lives in
tokenizer.py. This file never touches the KV cache or the model.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from tierkv import kernels
from tierkv.errors import ConfigError

# temperatures below this are greedy: dividing logits by ~0 overflows to inf
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass(slots=True, init=False)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    temperature 0 is greedy. top_k <= 0 and top_p 1 and min_p 0 disable those filters.
    repetition_penalty (HF/vLLM style, over prompt and output) divides positive logits of seen
    tokens and multiplies negative ones; presence/frequency penalties (OpenAI style) subtract
    per output token. max_tokens None means up to the model's maximum length. min_tokens: as in
    vLLM, the end-of-sequence ids (unless ignore_eos) and stop_token_ids are never sampled before
    that many tokens are out (their logits are -inf), and stop strings count only after them.
    logprobs None returns none; k >= 0 returns the sampled token's log-probability and the top k.
    As in vLLM, the text ends before the stop string that ended it, and leaves out the text of the
    token that ended it (an end-of-sequence id or one of stop_token_ids; its id stays in the token
    ids); include_stop_str_in_output keeps either.

    n > 1 asks for n choices of one prompt (parallel sampling): the prompt is computed and
    stored once and the choices share its KV. Choice i samples with seed `seed + i` (as vLLM
    does; see `choice_seed`), so it gives exactly what n=1 with that seed gives.
    """

    max_tokens: int | None
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int | None
    skip_special_tokens: bool
    n: int

    def __init__(
        self,
        *,
        max_tokens: int | None = 64,
        min_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        logprobs: int | None = None,
        skip_special_tokens: bool = True,
        n: int = 1,
        **unknown: object,
    ) -> None:
        if unknown:
            valid = [f.name for f in fields(SamplingParams)]
            name = sorted(unknown)[0]
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown sampling option {name!r}{hint}; valid options: {', '.join(valid)}")
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.repetition_penalty = repetition_penalty
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.seed = seed
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        self.stop_token_ids = tuple(stop_token_ids or ())
        self.ignore_eos = ignore_eos
        self.include_stop_str_in_output = include_stop_str_in_output
        self.logprobs = logprobs
        self.skip_special_tokens = skip_special_tokens
        self.n = n
        self._validate()

    @classmethod
    def from_dict(cls, options: dict) -> SamplingParams:
        """Build from a plain dict (e.g. request JSON); unknown keys raise ConfigError."""
        return cls(**options)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def stop_buffer_length(self) -> int:
        """Characters a stream holds back until the request finishes (vLLM's name and rule): a stop
        string that the next tokens complete may begin in them, and the text before it is all that
        is kept. 0 when the stop string stays in the output anyway."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def penalizes_output(self) -> bool:
        """Whether sampling reads the request's own output (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def _validate(self) -> None:
        def fail(field: str, rule: str) -> None:
            raise ConfigError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens <= 0):
            fail("max_tokens", "must be a positive int (or None for up to the model's length)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a number >= 0 (0 is greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1] (1 disables it)")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an int >= 1, or 0 / -1 to disable it")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1] (0 disables it)")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                fail(name, "must be in [-2, 2] (0 disables it)")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            fail("seed", "must be an int (64-bit) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of them")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of token ids (ints >= 0)")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be True or False")
        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an int >= 1 (the number of choices)")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: seed + index (mod 2**64, as
    make_generator takes it), as vLLM derives it. Choice 0 keeps the request's seed, so n=1 is
    unchanged, and a fixed seed gives reproducible choices that differ from each other."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % 2**64  # the same generator as seed + index, and a valid seed


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator of the request's own when it has a seed; the request keeps it across steps."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed % 2**64)
    return gen


@dataclass(slots=True)
class SamplingBatch:
    """The params of B rows as tensors on the logits' device, plus host-side flags."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    temperature: torch.Tensor | None  # [B] fp32, 1 on greedy rows (they take the argmax); None if all greedy
    greedy: torch.Tensor | None  # [B] bool; None if all greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where off
    top_p: torch.Tensor | None  # [B] fp32
    min_p: torch.Tensor | None  # [B] fp32
    seen: torch.Tensor | None  # [B, V] bool, token appears in prompt or output
    repetition_penalty: torch.Tensor | None  # [B, 1] fp32
    counts: torch.Tensor | None  # [B, V] fp32, occurrences in the output
    presence_penalty: torch.Tensor | None  # [B, 1] fp32
    frequency_penalty: torch.Tensor | None  # [B, 1] fp32
    all_greedy: bool
    max_logprobs: int | None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) whose logits are -inf: min_tokens

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        generators: list[torch.Generator | None] | None = None,
        prompt_ids: list[Sequence[int]] | None = None,
        output_ids: list[Sequence[int]] | None = None,
        num_output: list[int] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatch:
        """prompt_ids / output_ids are needed only by rows with a penalty. num_output: tokens each
        row's request has sampled so far, those on their way back included (default: its
        output_ids); with eos_token_ids, what min_tokens needs."""
        b = len(params)

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        greedy = [p.greedy for p in params]
        seen = counts = repetition = presence = frequency = None
        if any(p.repetition_penalty != 1.0 for p in params):
            if prompt_ids is None or output_ids is None:
                raise ValueError("repetition_penalty needs prompt_ids and output_ids")
            seen = torch.zeros(b, vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.repetition_penalty != 1.0:
                    seen[i, torch.tensor([*prompt_ids[i], *output_ids[i]], dtype=torch.long)] = True
            seen = seen.to(device, non_blocking=True)
            repetition = col([[p.repetition_penalty] for p in params], torch.float32)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            if output_ids is None:
                raise ValueError("presence/frequency penalties need output_ids")
            counts = torch.zeros(b, vocab_size)
            for i, ids in enumerate(output_ids):
                counts[i].index_add_(0, torch.tensor(list(ids), dtype=torch.long), torch.ones(len(ids)))
            counts = counts.to(device, non_blocking=True)
            presence = col([[p.presence_penalty] for p in params], torch.float32)
            frequency = col([[p.frequency_penalty] for p in params], torch.float32)
        banned = None
        if any(p.min_tokens for p in params):
            counts_out = num_output if num_output is not None else [len(ids) for ids in output_ids or [()] * b]
            rows, cols = [], []
            for i, (p, n) in enumerate(zip(params, counts_out)):
                if n < p.min_tokens:
                    # ids past the vocabulary are never sampled: nothing to ban (and no column to index)
                    ids = {t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if t < vocab_size}
                    rows += [i] * len(ids)
                    cols += ids
            if rows:
                banned = (col(rows, torch.int64), col(cols, torch.int64))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        # an all-greedy batch (the usual decode step) builds no per-row columns: each is a host
        # tensor and a copy every step, which the argmax never reads
        all_greedy = all(greedy)
        return cls(
            params=params,
            generators=generators or [None] * b,
            temperature=None if all_greedy else col([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                                    torch.float32),
            greedy=None if all_greedy else col(greedy, torch.bool),
            top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
            if any(p.top_k > 0 for p in params) else None,
            top_p=col([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            min_p=col([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            seen=seen,
            repetition_penalty=repetition,
            counts=counts,
            presence_penalty=presence,
            frequency_penalty=frequency,
            all_greedy=all_greedy,
            max_logprobs=max(wanted) if wanted else None,
            banned=banned,
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] fp32, log-probability of the chosen token
    top_ids: torch.Tensor | None = None  # [B, k] int64, most likely tokens
    top_logprobs: torch.Tensor | None = None  # [B, k] fp32


# The argmax runs in two stages over this many slices of a row: torch reduces a single row of a
# 128K vocabulary in one thread block (28 us on the H200, against ~2 us to read it), and a
# batch-1 decode step pays that every token.
_ARGMAX_SLICES = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, the first index of each row's largest value (as torch.argmax)."""
    b, v = logits.shape
    if v % _ARGMAX_SLICES or v < 8 * _ARGMAX_SLICES:
        return logits.argmax(dim=-1)  # a vocabulary that does not slice evenly, or too small to gain
    best, where = logits.view(b, _ARGMAX_SLICES, v // _ARGMAX_SLICES).max(dim=-1)  # [B, S]: first max per slice
    piece = best.argmax(dim=-1, keepdim=True)  # [B, 1]: the first slice that holds the row's max
    return (piece * (v // _ARGMAX_SLICES) + where.gather(1, piece))[:, 0]


class Sampler:
    """logits [B, V] -> next token per row, per its SamplingParams."""

    @staticmethod
    def compile(vocab_size: int, device: torch.device) -> None:
        """Run each top-k / top-p filter variant once (top-k, top-p, both), so that Triton
        compiles them before serving: the first request asking for one would otherwise stall
        its whole step for ~0.5 s (H100). Nothing to do off CUDA (the reference has no compile)."""
        if device.type != "cuda":
            return
        logits = torch.zeros(1, vocab_size, device=device)  # [1, V] fp32, as __call__ filters them
        top_k = torch.ones(1, dtype=torch.int64, device=device)
        top_p = torch.ones(1, dtype=torch.float32, device=device)
        for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
            kernels.top_k_top_p_filter(logits, k, p)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        # log-probabilities of the model's own distribution, before any penalty or filter
        logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        logits = self._penalize(logits, batch)
        if batch.banned is not None:  # min_tokens: no end yet (a copy: the caller's logits stay as they are)
            logits = logits.index_put(batch.banned, torch.tensor(-math.inf, device=logits.device))
        tokens = greedy_tokens(logits)  # [B]
        if not batch.all_greedy:
            sampled = self._sample(logits, batch)
            tokens = torch.where(batch.greedy, tokens, sampled)
        out = SamplerOutput(tokens)
        if logprobs is not None:
            out.logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
            if batch.max_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
        return out

    @staticmethod
    def _penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.seen is not None:
            penalty = batch.repetition_penalty  # [B, 1]
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(batch.seen, scaled, logits)
        if batch.counts is not None:
            counts = batch.counts  # [B, V]
            logits = logits - batch.frequency_penalty * counts - batch.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]  # [B, V]
        if batch.top_k is not None or batch.top_p is not None:
            # Sorted, rank r is kept while r < k and the probability mass strictly before it is
            # < p (so the top token always stays); p's mass is over the whole row, not only the
            # top-k survivors, and tokens tied in logit share one fate (a tie at the boundary
            # keeps them all). On CUDA a bisection kernel finds the same set without a sort.
            logits = kernels.top_k_top_p_filter(logits, batch.top_k, batch.top_p)  # [B, V]
        probs = logits.softmax(dim=-1)  # [B, V]
        if batch.min_p is not None:
            # keep tokens at least min_p times as likely as the most likely one
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
        # Seeded rows draw their noise from their own generator, so their choices do not
        # depend on the other rows of the batch.
        noise = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # a zero draw would turn 0 / 0 into NaN, which argmax would pick
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def stop_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_ids: Sequence[int]
) -> str | None:
    """"stop" for an eos (unless ignore_eos) or a stop token id once min_tokens are out, "length" at
    max_tokens, else None.

    num_output_tokens counts the output including `token_id`."""
    ends = (not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids
    if ends and num_output_tokens >= params.min_tokens:
        return "stop"
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length"
    return None


def find_stop_string(text: str, num_new_chars: int, params: SamplingParams) -> int | None:
    """Where to cut `text` if its last `num_new_chars` characters completed a stop string.

    Returns the length of the text to keep (the stop string excluded unless
    include_stop_str_in_output), or None when no stop string ends in the new text. Only the
    tail that the new characters could touch is searched, so each step costs O(new + stop).
    """
    best: tuple[int, int] | None = None  # (where the earliest stop string starts, its length)
    for stop in params.stop:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, len(stop))
    if best is None:
        return None
    at, length = best
    return at + length if params.include_stop_str_in_output else at
