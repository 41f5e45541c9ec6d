"""What bench_serving sends: the four workloads as sources of requests for an open-loop sweep
(multi-round QA, long-document QA, generated shared prefix, all unique), seeded token-id prompts,
the prompts that prime a cache before the sweep, and each workload's KV footprint. A source
decides what the next request is, never when it is sent (that is the sweep's Poisson clock).

multi_round (LMCache's multi-round QA under open-loop arrivals) keeps --mr-users conversations
live. Each conversation is a shared system prompt + its own context + the rounds so far; a round
sends history + a new question, and the answer (the ids as returned, or a seeded stand-in where
the server has a tokenizer) joins the history. Every arrival of the Poisson clock is one round
of the conversation that has been idle longest (FIFO); a conversation is idle once its previous
answer arrived, so no conversation ever has two rounds in flight. If all conversations are busy
the arrival waits for the next one to go idle, and that wait counts in its TTFT (which is
measured from the arrival): with U conversations and an end-to-end latency E, no rate above U / E
can hold, and the points' wait_ms show when the conversations rather than the server are the
limit. A conversation that finished --mr-rounds rounds retires and a new one
(fresh context, a cold first round) takes its place. The pool starts in steady state: conversation
i has already done i mod R rounds ("virtual history", with stand-in answers), so retirements are
spread out rather than all cold at once; priming sends each history once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("multi_round", "long_doc", "shared_prefix", "unique")
FLAG_PREFIX = {"multi_round": "mr", "long_doc": "ld", "shared_prefix": "sp", "unique": "uq"}  # --mr-users, ...
FIRST_ID = 100  # random prompt ids start here, clear of the special tokens real vocabularies begin with


def rng_for(seed: int, name: str, *more: int) -> np.random.Generator:
    """One generator per workload (and purpose), so a workload's prompts do not depend on what else runs."""
    return np.random.default_rng([seed, WORKLOADS.index(name), *more])


def random_ids(g: np.random.Generator, n: int, vocab: int) -> list[int]:
    return g.integers(FIRST_ID, vocab, n).tolist()


def flags(a, name: str) -> dict:
    """The workload's own flags (--mr-*, ...) without their prefix: its shape, for sizing and the JSON."""
    prefix = FLAG_PREFIX[name] + "_"
    return {k[len(prefix):]: v for k, v in vars(a).items() if k.startswith(prefix)}


@dataclass(slots=True)
class Ask:
    """One request a source hands out; `done` must get it back, answered or not."""
    prompt: list[int]
    max_tokens: int
    stand_in: list[int] = field(default_factory=list)  # the answer to use where the server returns text
    conversation: object = None


class Source:
    """A stateless workload: every request is drawn independently."""

    def __init__(self, name: str, shape: dict, kv_tokens: int, largest_request: int, answer_tokens: int,
                 g: np.random.Generator, vocab: int) -> None:
        self.name, self.shape, self.kv_tokens, self.largest_request = name, shape, kv_tokens, largest_request
        self.answer_tokens, self.g, self.vocab = answer_tokens, g, vocab
        self.answers = {"returned": 0, "stand_in": 0}

    def prime_prompts(self) -> list[list[int]]:
        return []

    def draw(self) -> list[int]:
        raise NotImplementedError

    async def take(self) -> Ask:
        return Ask(self.draw(), self.answer_tokens)

    def done(self, ask: Ask, answer: list[int] | None, ok: bool) -> None:
        pass


class PrefixPool(Source):
    """A question behind one of `count` prefixes drawn uniformly: LMCache's long-document QA (the
    prefixes are documents) and SGLang's generated shared prefix (system prompts)."""

    def __init__(self, a, vocab: int, name: str, count: int, prefix_tokens: int, question_tokens: int,
                 answer_tokens: int) -> None:
        g = rng_for(a.seed, name)
        self.prefixes = [random_ids(g, prefix_tokens, vocab) for _ in range(count)]
        self.question_tokens = question_tokens
        super().__init__(name, flags(a, name), count * prefix_tokens,
                         prefix_tokens + question_tokens + answer_tokens, answer_tokens, g, vocab)

    def prime_prompts(self) -> list[list[int]]:
        return self.prefixes

    def draw(self) -> list[int]:
        return self.prefixes[self.g.integers(len(self.prefixes))] + random_ids(self.g, self.question_tokens, self.vocab)


def long_doc(a, vocab: int) -> PrefixPool:
    return PrefixPool(a, vocab, "long_doc", a.ld_docs, a.ld_doc_tokens, a.ld_question_tokens, a.ld_answer_tokens)


def shared_prefix(a, vocab: int) -> PrefixPool:
    return PrefixPool(a, vocab, "shared_prefix", a.sp_groups, a.sp_system_tokens, a.sp_question_tokens,
                      a.sp_answer_tokens)


class Unique(Source):
    """Random prompts that never share a block (two share one with probability ~vocab^-16): what
    caching costs when every lookup misses. Its nominal KV sizes L1 to hold 4 requests."""

    def __init__(self, a, vocab: int) -> None:
        largest = a.uq_prompt_tokens + a.uq_answer_tokens
        super().__init__("unique", flags(a, "unique"), 16 * largest, largest, a.uq_answer_tokens,
                         rng_for(a.seed, "unique"), vocab)
        self.prompt_tokens = a.uq_prompt_tokens

    def draw(self) -> list[int]:
        return random_ids(self.g, self.prompt_tokens, self.vocab)


@dataclass(slots=True)
class Conversation:
    history: list[int]  # system + context + every round so far (question + answer)
    rounds_left: int


class MultiRound(Source):
    """LMCache's multi-round QA with the conversation model of the module docstring."""

    def __init__(self, a, vocab: int) -> None:
        g = rng_for(a.seed, "multi_round")
        self.R, self.q, self.ctx = a.mr_rounds, a.mr_question_tokens, a.mr_context_tokens
        self.system = random_ids(g, a.mr_system_tokens, vocab)
        per_conversation = a.mr_context_tokens + a.mr_rounds * (a.mr_question_tokens + a.mr_answer_tokens)
        super().__init__("multi_round", flags(a, "multi_round"), a.mr_system_tokens + a.mr_users * per_conversation,
                         a.mr_system_tokens + per_conversation, a.mr_answer_tokens, g, vocab)
        self.pool = []
        for i in range(a.mr_users):
            c = self.fresh()
            for _ in range(i % self.R):  # virtual history: spread the conversations over their rounds
                c.history += random_ids(g, self.q, vocab) + random_ids(g, self.answer_tokens, vocab)
                c.rounds_left -= 1
            self.pool.append(c)
        self.idle: asyncio.Queue | None = None  # made in the event loop that runs the sweep
        self.retired = 0

    def fresh(self) -> Conversation:
        return Conversation(self.system + random_ids(self.g, self.ctx, self.vocab), self.R)

    def prime_prompts(self) -> list[list[int]]:
        return [c.history for c in self.pool]

    async def take(self) -> Ask:
        if self.idle is None:
            self.idle = asyncio.Queue()
            for i in self.g.permutation(len(self.pool)):
                self.idle.put_nowait(self.pool[i])
        c = await self.idle.get()
        return Ask(c.history + random_ids(self.g, self.q, self.vocab), self.answer_tokens,
                   random_ids(self.g, self.answer_tokens, self.vocab), c)

    def done(self, ask: Ask, answer: list[int] | None, ok: bool) -> None:
        c = ask.conversation
        if ok:  # a failed or cut round is asked again later, the history unchanged
            returned = answer is not None and len(answer) == len(ask.stand_in)
            self.answers["returned" if returned else "stand_in"] += 1
            c.history = ask.prompt + (answer if returned else ask.stand_in)
            c.rounds_left -= 1
            if c.rounds_left == 0:
                self.retired += 1
                c = self.fresh()
        self.idle.put_nowait(c)


SOURCES = {"multi_round": MultiRound, "long_doc": long_doc, "shared_prefix": shared_prefix, "unique": Unique}
