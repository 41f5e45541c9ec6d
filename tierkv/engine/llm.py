"""LLM: offline generation in a few lines, on the bundled SmolLM2 or any supported checkpoint.

    llm = tierkv.LLM()                                    # bundled SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], tierkv.SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].cached_tokens, outs[0].finish_reason

With SamplingParams(n=4), outs[0].outputs holds the 4 choices (each with .index, .text,
.token_ids, .finish_reason, .logprobs), as in vLLM; the prompt is computed once for all of them.

A thin loop over `Engine`: queue every prompt, step until all are done, with a progress bar.
Never holds state of its own besides the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from ..errors import ConfigError
from .engine import Engine
from .request import RequestOutput
from .sampler import SamplingParams

# What generate() uses without sampling params: greedy, so that a first try prints the model's
# most likely continuation rather than a random one.
DEFAULT_PARAMS = SamplingParams(temperature=0.0, max_tokens=64)

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        """`model`: a Hugging Face model directory, or a hub id ("org/name", fetched into the HF
        cache, safetensors only); None is the bundled SmolLM2-135M-Instruct. Options: those of
        `EngineConfig` (l1, l2, l3, eviction, write_policy, block_size, enable_prefix_caching, max_model_len,
        max_num_batched_tokens, max_num_seqs, device, dtype, cache_dir, enforce_eager,
        async_scheduling, tensor_parallel_size). With tensor_parallel_size > 1 the other ranks are
        spawned processes: guard a script's top level with `if __name__ == "__main__":`, and
        `close()` (or the process's exit) stops them."""
        self.engine = Engine(model, **options)
        self.tokenizer = self.engine.tokenizer

    @property
    def cache(self):
        return self.engine.cache

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order, one
        per prompt. With n > 1 choices, an output's `outputs` lists them (its top-level fields are
        choice 0's)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params = self._per_prompt(sampling_params if sampling_params is not None else DEFAULT_PARAMS, len(prompts))
        priorities = self._per_prompt(priority, len(prompts))
        ids = [self._encode(p) for p in prompts]
        # validate everything before queueing anything: a bad prompt fails the call, not half of it
        reqs = []
        try:
            for tokens, p, prio in zip(ids, params, priorities):
                reqs.append(self.engine.add_request(tokens, p, cache_salt=cache_salt, priority=prio))
        except Exception:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        order = {r.request_id: i for i, r in enumerate(reqs)}
        choices: list[list[RequestOutput | None]] = [[None] * len(r.choices) for r in reqs]
        with tqdm(total=len(reqs), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        choices[order[out.request_id]][out.index] = out
                        bar.update(out.request_finished)
        return [c[0] if len(c) == 1 else dataclasses.replace(c[0], choices=c) for c in choices]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer, so it has no chat template; use generate() with token ids")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in conversations:
            if not conv:
                raise ConfigError("a conversation needs at least one message")
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    @staticmethod
    def _per_prompt(value, n: int) -> list:
        if isinstance(value, (SamplingParams, int)):
            return [value] * n
        value = list(value)
        if len(value) != n:
            raise ConfigError(f"got {len(value)} per-prompt values for {n} prompts")
        return value

    def close(self) -> None:
        self.engine.close()
