"""The wire format of tierkv-serve: pydantic models of OpenAI's request and response shapes.

Requests are validated here (types, ranges, required fields, rules across fields) so that
FastAPI publishes the rules in its OpenAPI schema: a rule pydantic cannot state in JSON Schema
itself is checked by a validator (`refused`) and stated beside it. Rules that need the model
(context length, the model's name, the vocabulary) are checked where it is known (serving.py,
the engine). `APIError` is the one exception the server turns into OpenAI's error JSON. This file
holds data shapes only: no engine, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

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
REFUSED = "refused"  # the type of a validator's error: the app sends its message as it is


def refused(message: str, param: str | None = None) -> PydanticCustomError:
    """A rule that a validator checks broken: the app answers 400 with `message`, naming `param`
    (default: the field validated). No braces in `message`: pydantic formats it."""
    return PydanticCustomError(REFUSED, message, {"param": param} if param else None)


def _false_only(value: bool, info: ValidationInfo) -> bool:
    if value:
        raise refused(f"{info.field_name} is not supported: leave it out or send false")
    return value


# a field of OpenAI's or vLLM's that tierkv takes at false only: the schema says so, and true is refused
FalseOnly = Annotated[bool, AfterValidator(_false_only),
                      Field(description="not supported: false only", json_schema_extra={"const": False})]


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


PromptIds = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
One = Field(min_length=1, max_length=1)  # a list holding one prompt: no batches, one prompt a request


class CompletionRequest(_Sampling):
    # token ids first: a union tries its members in order, and a long id list checked against
    # list[str] first fails once per item (a 12K-token prompt took 6 ms to validate, now 0.2 ms)
    prompt: PromptIds | PromptText | Annotated[list[PromptText], One] | Annotated[list[PromptIds], One] = Field(
        description="one prompt, not empty: text or token ids (a list holding one prompt is accepted too; "
        "batches are not: one prompt per request)")
    max_tokens: int | None = Field(16, ge=1, le=INT64, description="OpenAI's default is 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: FalseOnly = False
    best_of: int | None = Field(None, ge=1, le=1, description="not supported: 1 (or null) only")
    suffix: str | None = Field(None, max_length=0, description="not supported: empty (or null) only")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    # the schema's statement of the validator below (OpenAPI 3.1 schemas are JSON Schema 2020-12)
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})

    messages: list[ChatMessage] = Field(min_length=1, description="at least one message")
    max_tokens: int | None = Field(None, ge=1, le=INT64,
                                   description="deprecated by OpenAI; same as max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs set to true")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise refused("top_logprobs needs logprobs set to true", "top_logprobs")
        return self


class TokenizeRequest(BaseModel):
    """POST /tokenize, in vLLM's shape: a prompt, or messages rendered with the chat template."""

    # the schema's statement of the validator below: a prompt or messages, not both (or neither),
    # and add_special_tokens never true with messages
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
        "if": {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        "then": {"properties": {"add_special_tokens": {"not": {"const": True}}}}})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                            "(the chat template writes them; true is refused)")
    add_generation_prompt: bool = True
    continue_final_message: FalseOnly = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise refused("send either a prompt or messages", "prompt")
        if self.messages is not None and self.add_special_tokens:
            raise refused("add_special_tokens with messages is not supported: the chat template writes the special "
                          "tokens", "add_special_tokens")
        return self


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


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None


class CompletionChunk(BaseModel):
    """An event of a streamed completion. With stream_options.include_usage the last one has no
    choices and the usage; with continuous_usage_stats too, every one has the usage so far."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in each choice's first chunk
    content: str


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: dict | None


class ChatCompletionChunk(BaseModel):
    """An event of a streamed chat completion; usage as in CompletionChunk."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


STREAM_CHUNKS = (CompletionChunk, ChatCompletionChunk)  # no route returns them: publish_openapi adds them


def streamed(chunk: type[BaseModel]) -> dict:
    """OpenAPI of a generation route's 200 besides its JSON: with "stream": true, server-sent events
    whose data is a `chunk`, an ErrorResponse if the request fails on its way, and at last [DONE].
    The schema is each event's, as OpenAPI 3.1 has it."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in (chunk, ErrorResponse)]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"data": data},
        "description": f'with "stream": true: an event `data: {{...}}` per step, each a {chunk.__name__}, then '
        "`data: [DONE]`"}}}}}


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


def publish_openapi(schemas: dict, strict: bool) -> None:
    """Add to the OpenAPI components FastAPI made (`schemas`) what the routes do not tell it: the
    streamed chunks (no route returns them as its model), and what the server does with the
    unknown fields of each request that keeps them: with `strict`, it takes none; else it takes any,
    except that of FOREIGN_FIELDS it takes the neutral values only."""
    _, chunks = models_json_schema([(m, "serialization") for m in STREAM_CHUNKS],
                                   ref_template="#/components/schemas/{model}")
    for name, schema in chunks["$defs"].items():
        schemas.setdefault(name, schema)
    for schema in schemas.values():
        if schema.get("additionalProperties") is not True:  # responses, and the shapes inside requests
            continue
        if strict:
            schema["additionalProperties"] = False
            continue
        props = schema.setdefault("properties", {})
        for name, neutral in FOREIGN_FIELDS.items():
            if neutral is not ANY and name not in props:
                props[name] = {"enum": list(neutral), "description": "another server's field, taken here only at a "
                               "value that changes nothing"}
