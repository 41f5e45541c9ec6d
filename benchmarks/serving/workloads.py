"""The four traces bench_serving replays (multi-round QA, long-document QA, shared prefix, all
unique) and their sizing: seeded token-id prompts, arrival times and each trace's KV footprint.
Building a trace sends nothing; the same flags and seed give the same trace in every config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("multi_round", "long_doc", "shared_prefix", "unique")
FIRST_ID = 100  # random prompt ids start here, clear of the special tokens real vocabularies begin with


@dataclass(slots=True)
class Planned:
    """One request of a fixed trace."""
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the workload starts; sent then or when a slot frees


@dataclass(slots=True)
class User:
    """One multi-round user: its rounds' prompts depend on the answers it gets."""
    arrival: float
    context: list[int]  # the shared system prompt + this user's own context
    questions: list[list[int]]
    think: list[float]  # seconds between an answer and the next round
    stand_in: list[list[int]]  # answers to use where the server returns no token ids (it has a tokenizer)


@dataclass(slots=True)
class Workload:
    name: str
    shape: dict  # the sizes it was built from, for the JSON
    concurrency: int  # requests (or multi-round users) in flight at once
    kv_tokens: int  # distinct tokens the trace makes KV for: its footprint in a cache
    largest_request: int  # prompt + answer tokens of its longest request
    requests: list[Planned] = field(default_factory=list)
    users: list[User] = field(default_factory=list)

    @property
    def planned(self) -> int:
        return len(self.requests) + sum(len(u.questions) for u in self.users)


def rng_for(seed: int, name: str) -> np.random.Generator:
    """One generator per workload, so each workload's trace is the same whatever else is selected."""
    return np.random.default_rng([seed, WORKLOADS.index(name)])


def random_ids(g: np.random.Generator, n: int, vocab: int) -> list[int]:
    return g.integers(FIRST_ID, vocab, n).tolist()


def arrivals(g: np.random.Generator, n: int, rate: float) -> list[float]:
    """Poisson arrival times at `rate` per second (all at 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    return np.cumsum(g.exponential(1.0 / rate, n)).tolist()


def flags(a, prefix: str) -> dict:
    """The workload's sizing flags, for the JSON (which has no infinity: an unlimited rate is 'inf')."""
    return {k[len(prefix):]: ("inf" if v == math.inf else v) for k, v in vars(a).items() if k.startswith(prefix)}


def build_multi_round(a, vocab: int) -> Workload:
    """Users with Poisson arrivals, each a context behind the shared system prompt and R questions."""
    g, R, A = rng_for(a.seed, "multi_round"), a.mr_rounds, a.mr_answer_tokens
    system = random_ids(g, a.mr_system_tokens, vocab)
    users = [User(t, system + random_ids(g, a.mr_context_tokens, vocab),
                  [random_ids(g, a.mr_question_tokens, vocab) for _ in range(R)],
                  g.exponential(a.mr_think_time, R - 1).tolist() if a.mr_think_time > 0 else [0.0] * (R - 1),
                  [random_ids(g, A, vocab) for _ in range(R)])
             for t in arrivals(g, a.mr_users, a.mr_rate)]
    per_user = a.mr_context_tokens + R * (a.mr_question_tokens + A)
    # KV: the shared system prompt once, and each user's context and rounds (question + answer)
    return Workload("multi_round", flags(a, "mr_"), a.mr_max_active_users, a.mr_system_tokens + a.mr_users * per_user,
                    a.mr_system_tokens + per_user, users=users)


def build_long_doc(a, vocab: int) -> Workload:
    """Every document asked --ld-questions times, all the asks shuffled together."""
    g, A = rng_for(a.seed, "long_doc"), a.ld_answer_tokens
    docs = [random_ids(g, a.ld_doc_tokens, vocab) for _ in range(a.ld_docs)]
    order = [d for d in range(a.ld_docs) for _ in range(a.ld_questions)]
    g.shuffle(order)
    requests = [Planned(docs[d] + random_ids(g, a.ld_question_tokens, vocab), A) for d in order]
    return Workload("long_doc", flags(a, "ld_"), a.ld_concurrency,
                    a.ld_docs * a.ld_doc_tokens + len(order) * (a.ld_question_tokens + A),
                    a.ld_doc_tokens + a.ld_question_tokens + A, requests=requests)


def build_shared_prefix(a, vocab: int) -> Workload:
    """Groups of questions behind one system prompt each, shuffled, arriving at --sp-rate."""
    g, A = rng_for(a.seed, "shared_prefix"), a.sp_answer_tokens
    systems = [random_ids(g, a.sp_system_tokens, vocab) for _ in range(a.sp_groups)]
    order = [s for s in range(a.sp_groups) for _ in range(a.sp_questions)]
    g.shuffle(order)
    times = arrivals(g, len(order), a.sp_rate)
    requests = [Planned(systems[s] + random_ids(g, a.sp_question_tokens, vocab), A, t) for s, t in zip(order, times)]
    return Workload("shared_prefix", flags(a, "sp_"), a.sp_concurrency,
                    a.sp_groups * a.sp_system_tokens + len(order) * (a.sp_question_tokens + A),
                    a.sp_system_tokens + a.sp_question_tokens + A, requests=requests)


def build_unique(a, vocab: int) -> Workload:
    """Random prompts: two share a 16-token block with probability ~vocab^-16, i.e. never."""
    g, A = rng_for(a.seed, "unique"), a.uq_answer_tokens
    requests = [Planned(random_ids(g, a.uq_prompt_tokens, vocab), A) for _ in range(a.uq_prompts)]
    return Workload("unique", flags(a, "uq_"), a.uq_concurrency, a.uq_prompts * (a.uq_prompt_tokens + A),
                    a.uq_prompt_tokens + A, requests=requests)


BUILDERS = {"multi_round": build_multi_round, "long_doc": build_long_doc,
            "shared_prefix": build_shared_prefix, "unique": build_unique}
