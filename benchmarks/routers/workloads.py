"""The multi-round chat workloads a fleet of replicas serves through a router: Workload (text, the
openai client, for a model with a tokenizer) and TokenWorkload (token ids, streamed, for a model
without one: --gpu, --smoke), and Turn, what one request of either gave back. They send requests;
they never start a process or read a server's state.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
from serving.client import Http, send
from serving.workloads import random_ids

BLOCK_SIZE = 16  # tierkv-serve's default, and what the router hashes prompts by

WORDS = ("cache", "block", "token", "prefix", "router", "replica", "memory", "tier", "host", "disk", "request",
         "latency", "model", "layer", "attention", "batch", "queue", "server", "client", "stream", "policy",
         "eviction", "hash", "chain", "index", "shard", "cluster", "bandwidth", "kernel", "decode", "prefill",
         "context", "window", "history", "question", "answer", "summary", "detail", "reason", "example")


@dataclass(slots=True)
class Turn:
    conversation: int
    round: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    ttft: float | None = None  # streamed requests only (TokenWorkload)
    completion_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    """`conversations` chats of `rounds` rounds; each round's prompt is the previous one, the
    model's answer and a new question (`first_words` long, then `next_words`). Conversation c
    starts `stagger_s` x c seconds in, as users do, rather than all in the same instant."""

    conversations: int = 6
    rounds: int = 4
    first_words: int = 100
    next_words: int = 30
    max_tokens: int = 4
    stagger_s: float = 0.5
    seed: int = 0

    def question(self, c: int, k: int) -> str:
        rng = random.Random(f"{self.seed}/{c}/{k}")  # the same question in every run and policy
        words = " ".join(rng.choice(WORDS) for _ in range(self.first_words if k == 0 else self.next_words))
        return f"Conversation {c}: {words}?" if k == 0 else f"And {words}?"

    def play(self, url: str, model: str, deadline: float = float("inf")) -> list[Turn]:
        return converse(url, model, self, deadline=deadline)


@dataclass(frozen=True)
class TokenWorkload:
    """Multi-round chat in token ids, for a model without a tokenizer (--gpu, --smoke), closed loop:
    `conversations` users at once, each starting `stagger_s` x its number in, and sending its next
    round as soon as its answer has arrived. Every conversation opens with one shared system prompt
    and a context of its own; a round adds a question, and the answer (`answer_tokens`, greedy, EOS
    ignored) joins the history as a seeded stand-in for what the model said: the prompts are then
    the same, token for token, under every policy (a returned answer may differ with the batch it
    ran in), and a round's cached prefix ends where the previous prompt did. Ids are drawn from
    [FIRST_ID, vocab), seeded per conversation. Histories are whole blocks (system + context, and
    question + answer, are multiples of the block size): a round's prompt is the last history's
    blocks and its question."""

    conversations: int = 32
    rounds: int = 4
    system_tokens: int = 256
    context_tokens: int = 7168  # with 4 rounds, 8064 tokens at the end: issue 40's 32 users x 8K
    question_tokens: int = 128
    answer_tokens: int = 32
    stagger_s: float = 0.05
    seed: int = 0
    vocab: int = 151936  # Qwen3's

    def __post_init__(self) -> None:
        first, per_round = self.system_tokens + self.context_tokens, self.question_tokens + self.answer_tokens
        if first % BLOCK_SIZE or per_round % BLOCK_SIZE:
            raise ValueError(f"system + context ({first}) and question + answer ({per_round}) tokens must be "
                             f"multiples of the block size, {BLOCK_SIZE}")

    def prompts(self, c: int) -> list[list[int]]:
        """Conversation c's prompt of each round."""
        system = random_ids(np.random.default_rng([self.seed]), self.system_tokens, self.vocab)
        g = np.random.default_rng([self.seed, 1 + c])
        history, out = system + random_ids(g, self.context_tokens, self.vocab), []
        for _ in range(self.rounds):
            out.append(history + random_ids(g, self.question_tokens, self.vocab))
            history = out[-1] + random_ids(g, self.answer_tokens, self.vocab)
        return out

    def kv_tokens(self) -> int:
        """Tokens of KV the whole workload leaves behind (the system prompt's blocks once)."""
        per = self.context_tokens + self.rounds * (self.question_tokens + self.answer_tokens)
        return self.system_tokens + self.conversations * per

    def play(self, url: str, model: str, deadline: float = float("inf")) -> list[Turn]:
        """Every conversation through `url`, each request streamed (serving.client.send: TTFT from
        the request's sending); a round not begun by `deadline` (time.monotonic()) is not sent."""

        async def run() -> list[Turn]:
            limits = httpx.Limits(max_connections=self.conversations + 4, max_keepalive_connections=self.conversations)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
                h = Http(client, url, {}, model, self.vocab)

                async def user(c: int) -> list[Turn]:
                    turns = []
                    await asyncio.sleep(c * self.stagger_s)
                    for k, prompt in enumerate(self.prompts(c)):
                        if time.monotonic() > deadline:
                            break
                        r = await send(h, prompt, self.answer_tokens)
                        turns.append(Turn(c, k, r.prompt_tokens, r.cached_tokens, r.e2e, r.error, r.ttft,
                                          r.completion_tokens))
                    return turns

                return [t for turns in await asyncio.gather(*map(user, range(self.conversations))) for t in turns]

        return asyncio.run(run())


def converse(url: str, model: str, work: Workload, rounds: range | None = None,
             histories: dict[int, list[dict]] | None = None, stop: threading.Event | None = None,
             deadline: float = float("inf")) -> list[Turn]:
    """Every conversation in a thread of its own, round after round through `url` (the real openai
    client, without retries of its own: a failure the router lets through is counted), until
    `rounds` are played, `stop` is set or `deadline` (time.monotonic()) has passed. `histories`
    carries conversations on from earlier rounds."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    histories = {} if histories is None else histories
    rounds = range(work.rounds) if rounds is None else rounds

    def chat(c: int) -> list[Turn]:
        turns, messages = [], histories.setdefault(c, [])
        time.sleep(c * work.stagger_s)
        for k in rounds:
            if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                break
            messages.append({"role": "user", "content": work.question(c, k)})
            turn, t0 = Turn(c, k), time.perf_counter()
            try:
                out = client.chat.completions.create(model=model, messages=messages, max_tokens=work.max_tokens,
                                                     temperature=0)
                turn.prompt_tokens = out.usage.prompt_tokens
                turn.cached_tokens = out.usage.prompt_tokens_details.cached_tokens
                messages.append({"role": "assistant", "content": out.choices[0].message.content})
            except openai.APIError as err:
                turn.error = f"{type(err).__name__}: {err}"
                messages.pop()
            turn.seconds = time.perf_counter() - t0
            turns.append(turn)
        return turns

    with ThreadPoolExecutor(work.conversations) as pool:
        return [t for turns in pool.map(chat, range(work.conversations)) for t in turns]
