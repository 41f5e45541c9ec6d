"""The HTTP clients bench_server_overhead times a streamed token-id completion with, each the way
its users call it: TTFT from when the client is asked, to the first token chunk's arrival. httpx
(the old method: body encoded before the timer, logprobs=1), the `openai` client (its own work on
the prompt counts; also when the request left it) and aiohttp (vLLM's benchmark_serving). They
only speak the public HTTP API and never decide what to send.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

class _Tokens:
    """Counts a stream's token chunks and times the first (seconds from `start`)."""

    def __init__(self, start: float) -> None:
        self.start, self.first, self.count = start, None, 0

    def event(self, event: dict, tokens: int = 1) -> None:
        """One parsed SSE event carrying `tokens` sampled tokens when it has choices (one chunk a
        token: the server's promise; the usage chunk has none)."""
        if "error" in event:
            raise RuntimeError(f"the stream ended in an error after {self.count} tokens: {event['error']}")
        if event.get("choices") and tokens:
            self.first = self.first if self.first is not None else time.perf_counter() - self.start
            self.count += tokens

    def done(self, max_tokens: int) -> float:
        if self.count != max_tokens:
            raise RuntimeError(f"{self.count} of {max_tokens} tokens came back")
        return self.first


class HttpxClient:
    """The old method: one keep-alive connection, each body encoded before its timer starts,
    logprobs=1 (tokens counted from the log-probabilities)."""

    def __init__(self, url: str, a) -> None:
        self.url, self.a = url, a
        self.http = httpx.Client(timeout=a.timeout)

    def ttft(self, prompt: list[int]) -> dict:
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": self.a.max_tokens, "temperature": 0,
                           "ignore_eos": True, "logprobs": 1, "stream": True}).encode()
        tokens = _Tokens(time.perf_counter())
        with self.http.stream("POST", self.url + "/v1/completions", content=body,
                              headers={"Content-Type": "application/json"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line.startswith("data: {"):  # tokens counted from the log-probabilities
                    event = json.loads(line[6:])
                    choice = (event.get("choices") or [{}])[0]
                    tokens.event(event, len((choice.get("logprobs") or {}).get("tokens") or ()))
        return dict(ttft_s=tokens.done(self.a.max_tokens))

    def close(self) -> None:
        self.http.close()


class OpenAIClient:
    """The openai client as users call it, timed from before the call: what it does to the prompt
    before a byte leaves counts. An httpx request hook notes when the request left it."""

    def __init__(self, url: str, a) -> None:
        import openai

        self.a, self.sent = a, None
        self.http = httpx.Client(timeout=a.timeout, event_hooks={"request": [self._sent]})
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=self.http, max_retries=0)

    def _sent(self, request) -> None:
        self.sent = time.perf_counter()

    def ttft(self, prompt: list[int]) -> dict:
        start = time.perf_counter()
        tokens = _Tokens(start)
        for chunk in self.client.completions.create(model="bench", prompt=prompt, max_tokens=self.a.max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
            tokens.event(chunk.model_dump())
        return dict(ttft_s=tokens.done(self.a.max_tokens), client_prep_s=self.sent - start)

    def close(self) -> None:
        self.client.close()


class AiohttpClient:
    """vLLM's benchmark_serving (backend_request_func): a ClientSession per request, the body
    serialised by `json=` after the timer starts, SSE lines parsed as they come."""

    def __init__(self, url: str, a) -> None:
        self.url, self.a = url, a
        self.loop = asyncio.new_event_loop()

    def ttft(self, prompt: list[int]) -> dict:
        return self.loop.run_until_complete(self._ttft(prompt))

    async def _ttft(self, prompt: list[int]) -> dict:
        import aiohttp

        payload = {"model": "bench", "prompt": prompt, "max_tokens": self.a.max_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.a.timeout)) as session:
            start = time.perf_counter()
            tokens = _Tokens(start)
            async with session.post(self.url + "/v1/completions", json=payload) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
                async for line in r.content:
                    line = line.strip()
                    if line.startswith(b"data: {"):
                        tokens.event(json.loads(line[6:]))
        return dict(ttft_s=tokens.done(self.a.max_tokens))

    def close(self) -> None:
        self.loop.close()


CLIENTS = {"httpx": HttpxClient, "openai": OpenAIClient, "aiohttp": AiohttpClient}  # by --clients name
