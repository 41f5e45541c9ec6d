"""The wire format of tierkv-serve: pydantic models of OpenAI's request and response shapes.

Requests are validated here (types, ranges, required fields) so that FastAPI publishes the
rules in its OpenAPI schema; rules that need the model (context length, the model's name) are
checked in app.py. `APIError` is the one exception the server turns into OpenAI's error JSON.
This file holds data shapes only: no engine, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64 = 2**63 - 1
MAX_LOGPROBS = 20  # the engine's limit (tierkv.engine.sampler.MAX_LOGPROBS)
# Stop strings are searched in the tail of the output at every step: keep them few and short.
MAX_STOP = 4  # OpenAI's limit
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 1024
LOAD_FORMATS = ("vllm", "sglang")  # GET /get_load's shapes: vllm-router's and sglang-router's

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT64)]


class APIError(Exception):
    """An error a client caused (or an overload it should retry), sent as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 409, 413, 429, 503)}  # for OpenAPI


# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="with include_usage: every chunk carries the usage so "
                                         "far (vLLM's extension)")


# Fields other OpenAI-compatible servers take and tierkv does not, with the values that change
# nothing here (ANY: no value does: tierkv has no reasoning parser, and hidden states are never
# returned). Routers add some to every request (vllm-router and sglang-router send
# `no_stop_trim`, `continue_final_message`, `separate_reasoning`, ... at their defaults). Another
# value of one of these changes the result, so it is refused with a 400 naming the field, never
# ignored. A field in neither the schema nor this table is ignored and counted as "other"
# (refused too with --strict-request-fields). The names double as the bounded label set of
# tierkv_request_unknown_fields_total.
ANY = None
FOREIGN_FIELDS: dict[str, tuple | None] = {
    # OpenAI's, not implemented
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "parallel_tool_calls": ANY, "echo": (None, False), "store": ANY, "metadata": ANY, "service_tier": ANY,
    # vLLM's
    "use_beam_search": (None, False), "prompt_logprobs": (None,), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "spaces_between_special_tokens": (None, True), "request_id": ANY,
    # SGLang's (sglang-router and vllm-router add the first five to every request)
    "no_stop_trim": (None, False), "return_hidden_states": (None, False), "separate_reasoning": ANY,
    "stream_reasoning": ANY, "include_reasoning": ANY, "regex": (None,), "json_schema": (None,), "ebnf": (None,),
    "lora_path": (None,), "rid": ANY,
}


class _Sampling(BaseModel):
    """Fields both endpoints share: OpenAI's, then tierkv's extras (as vLLM spells them)."""

    # Unknown fields are kept aside (model_extra): serving.extra_fields counts them, refuses the
    # ones that would change the result, and refuses all under --strict-request-fields.
    model_config = ConfigDict(extra="allow")

    model: str = Field(description="the served model name (GET /v1/models lists it)")
    n: int = Field(1, ge=1, le=128, description="choices per request; they share the prompt's KV (computed once), "
                   "choice i samples with seed + i")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters")
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # tierkv extras
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS,
                                   description="tenant id: requests with different salts never share cached KV")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="higher is scheduled first, preempted last")
    top_k: int = Field(0, ge=-1, le=INT64, description="0 or -1 disables it")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64, description="tokens generated before EOS or a stop token id may "
                            "end the output (they are never sampled before that) and before a stop string counts")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Sampling):
    # token ids first: a union tries its members in order, and a long id list checked against
    # list[str] first fails once per item (a 12K-token prompt took 6 ms to validate, now 0.2 ms)
    prompt: list[int] | str | list[str] | list[list[int]] = Field(
        description="one prompt: text or token ids (a list holding one prompt is accepted too)")
    max_tokens: int | None = Field(16, ge=1, le=INT64, description="OpenAI's default is 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="at least one message")
    max_tokens: int | None = Field(None, ge=1, le=INT64, description="deprecated by OpenAI; same as max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(BaseModel):
    """POST /tokenize, in vLLM's shape: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                            "(the chat template writes them)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierkv"
    root: str | None = Field(None, description="the directory holding the model's tokenizer files (vLLM's root)")
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
