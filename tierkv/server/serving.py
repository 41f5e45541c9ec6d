"""From an OpenAI request to engine input, and from engine outputs to OpenAI responses.

`prepare_*` check what the schema cannot (model name, fields other servers take) and return the
function that tokenizes the prompt, checks the context length and builds the SamplingParams (run
with the server's copy of the tokenizer on a thread of its own: tokenizing.py). The `*_logprobs` helpers
and `sse` shape response bodies and SSE chunks. Pure functions of their inputs: no I/O, no engine
state, nothing HTTP beyond the JSON shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..engine.sampler import SamplingParams
from .protocol import (
    ANY,
    FOREIGN_FIELDS,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Sampling,
)

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def check_model(model: str | None, served_names: list[str]) -> None:
    """None is any model: the fields where vLLM makes the model optional (/tokenize)."""
    if model is not None and model not in served_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served_names[0]!r}",
                       param="model", code="model_not_found")


def extra_fields(body: BaseModel, strict: bool) -> list[str]:
    """The body's fields that its schema does not take, as the labels to count them under (a
    FOREIGN_FIELDS name, else "other"). A foreign field whose value would change the result here
    is refused; with `strict`, every such field is."""
    labels = []
    for name, value in (body.model_extra or {}).items():
        shown = name if len(name) <= 64 else name[:64] + "..."
        if strict:
            raise APIError(400, f"unknown field {shown!r}: this server takes no such field (it refuses unknown "
                           "fields: --strict-request-fields)", param=shown, code="unknown_field")
        neutral = FOREIGN_FIELDS.get(name, ANY)
        if neutral is not ANY and value not in neutral:
            values = " or ".join(json.dumps(v) for v in neutral)  # as JSON spells them: null, not None
            raise APIError(400, f"{name} is not supported by this server: leave it out or send {values}",
                           param=name, code="unsupported_field")
        labels.append(name if name in FOREIGN_FIELDS else "other")
    return labels


def _params(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> dict:
    return dict(
        max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens, n=req.n,
    )


@dataclass(frozen=True, slots=True)
class Encode:
    """(tokenizer or None) -> (prompt ids, SamplingParams). `tokenizes`: whether it uses the
    tokenizer; one that does not (a token-id prompt) is O(1) Python work (Tokenizing.run does it
    on the event loop, with no hop to the tokenizing thread)."""

    fn: Callable[[Any], tuple[list[int], SamplingParams]]
    tokenizes: bool

    def __call__(self, tokenizer) -> tuple[list[int], SamplingParams]:
        return self.fn(tokenizer)


def _encoder(prompt: Callable[[Any], list[int]], params: dict, max_model_len: int, param: str,
             tokenizes: bool = True) -> Encode:
    """The function that tokenizes the prompt (with the server's copy of the tokenizer, on its own
    thread: never the engine's), checks the context budget and builds the SamplingParams."""

    def encode(tokenizer) -> tuple[list[int], SamplingParams]:
        ids = prompt(tokenizer)
        if not ids:  # a text the tokenizer drops whole (SmolLM2's drops "\x06"): ids are never empty (schema)
            raise APIError(400, "the prompt's text gives no tokens with this model's tokenizer: send text it "
                           "encodes, or the prompt as token ids", param=param, code="empty_prompt")
        if len(ids) >= max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {max_model_len} "
                           "tokens (one is left for the output): shorten the prompt",
                           param=param, code="context_length_exceeded")
        max_tokens, min_tokens = params["max_tokens"], params["min_tokens"]
        if len(ids) + min_tokens > max_model_len:
            raise APIError(400, f"min_tokens is {min_tokens} but the prompt has {len(ids)} tokens and the context "
                           f"is {max_model_len}: ask for at most {max_model_len - len(ids)} tokens",
                           param="min_tokens", code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > max_model_len:
            raise APIError(400, f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the "
                           f"context is {max_model_len}: ask for at most {max_model_len - len(ids)} tokens",
                           param="max_tokens", code="context_length_exceeded")
        return ids, SamplingParams(**params)

    return Encode(encode, tokenizes)


def prepare_completion(req: CompletionRequest, served_names: list[str], max_model_len: int) -> Encode:
    check_model(req.model, served_names)
    prompt = req.prompt  # not empty, and a list holds one prompt at most (the schema's rules)
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        def tokens(tokenizer) -> list[int]:
            return text_tokens(tokenizer, prompt, max_model_len)
    else:
        ids = list(prompt)
        tokens = lambda tokenizer: ids
    return _encoder(tokens, _params(req, req.max_tokens, req.logprobs), max_model_len, "prompt",
                    tokenizes=isinstance(prompt, str))


def text_tokens(tokenizer, text: str, max_model_len: int, add_special_tokens: bool = True,
                param: str = "prompt") -> list[int]:
    """The token ids of `text`. A text whose length alone shows that it cannot fit the context
    (Tokenizer.fewest_tokens, a bound never above the real count) is refused without tokenizing it:
    a 1 MiB prompt costs ~0.5 s of CPU to tokenize, and a client looping them would keep a core busy."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
    fewest = tokenizer.fewest_tokens(text)
    if fewest >= max_model_len:
        raise APIError(400, f"the prompt has at least {fewest} tokens ({len(text)} characters); this model's context "
                       f"is {max_model_len} tokens (one is left for the output): shorten the prompt",
                       param=param, code="context_length_exceeded")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: text parts joined, `developer` as `system`."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def apply_chat_template(tokenizer, messages: list[dict], max_model_len: int, add_generation_prompt: bool = True
                        ) -> list[int]:
    """The token ids of `messages` in the chat template; refused untokenized when the text the
    template writes is too long for the context (text_tokens)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template: use /v1/completions "
                       "with token ids", param="messages")
    # the template writes BOS and friends itself
    return text_tokens(tokenizer, tokenizer.render_chat(messages, add_generation_prompt), max_model_len,
                       add_special_tokens=False, param="messages")


def prepare_chat(req: ChatCompletionRequest, served_names: list[str], max_model_len: int) -> Encode:
    check_model(req.model, served_names)
    messages = chat_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _encoder(lambda tokenizer: apply_chat_template(tokenizer, messages, max_model_len),
                    _params(req, max_tokens, logprobs), max_model_len, "messages")


# ---------------------------------------------------------------------------- responses


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's legacy shape. text_offset: where each token's text starts in the completion
    (`offset` is the length of the text sent before these entries, when streaming)."""
    starts = []
    for e in entries:
        starts.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict(zip(e["top_tokens"], (lp for _, lp in e["top"]))) for e in entries],
        "text_offset": starts,
    }


def chat_logprobs(entries: list[dict]) -> dict:
    def item(token: str, lp: float) -> dict:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {"content": [
        {**item(e["token"], e["logprob"]),
         "top_logprobs": [item(t, lp) for t, (_, lp) in zip(e["top_tokens"], e["top"])]}
        for e in entries
    ]}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
