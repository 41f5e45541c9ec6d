"""tierkv-serve's OpenAPI schema against the server itself: the schema refuses a body exactly when
the server does (a list of edge cases, checked with jsonschema), and schemathesis' positive and
negative cases for every operation get no 5xx and only answers the schema documents. One SmolLM2
server for the module, set up as test_server.py's (smol_server.py).
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
import smol_server
from smol_server import AUTH, MODEL, VOCAB, post, still_answers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from smol_server.start(tmp_path_factory)


# ---------------------------------------------------------------------------- the OpenAPI schema

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA_CASES = [  # (route, body): the schema refuses a body exactly when the server does
    ("/v1/completions", {"prompt": ""}), ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [""]}), ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": ["Hello", "there"]}), ("/v1/completions", {"prompt": [[1], [2]]}),
    ("/v1/completions", {"prompt": [-1]}), ("/v1/completions", {"prompt": "hi", "echo": True}),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}), ("/v1/completions", {"prompt": "hi", "suffix": "x"}),
    ("/v1/completions", {"prompt": "hi"}), ("/v1/completions", {"prompt": ["hi"]}),
    ("/v1/completions", {"prompt": [[9, 8]]}), ("/v1/completions", {"prompt": "hi", "echo": False, "best_of": 1,
                                                                    "suffix": ""}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 2}}), ("/v1/completions", {"prompt": "hi", "tools": []}),
    ("/v1/completions", {"prompt": "hi", "no_stop_trim": False, "logit_bias": None, "anything": {"else": 1}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2, "logprobs": False}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2, "logprobs": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": None}),
    ("/tokenize", {}), ("/tokenize", {"prompt": None}), ("/tokenize", {"prompt": "hi", "messages": MESSAGES}),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}),
    ("/tokenize", {"prompt": "hi"}), ("/tokenize", {"prompt": ""}), ("/tokenize", {"messages": MESSAGES}),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": False}),
]


def test_openapi_says_what_the_server_does(server):
    jsonschema = pytest.importorskip("jsonschema")
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                 "text/event-stream"}
    for method in ("get", "head"):
        assert set(doc["paths"]["/metrics"][method]["responses"]["200"]["content"]) == {"text/plain"}
    refused = []
    for path, fields in SCHEMA_CASES:
        body = {"model": MODEL, **fields, **({} if path == "/tokenize" else {"max_tokens": 1})}
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema_refuses = not jsonschema.Draft202012Validator({**ref, "components": doc["components"]}).is_valid(body)
        r = post(server, path, body)
        assert r.status_code in (200, 400), r.text
        assert schema_refuses == (r.status_code == 400), (path, fields, r.text)
        refused.append(schema_refuses)
    assert refused.count(True) == 18  # the cases above that are refused


# ---------------------------------------------------------------------------- schemathesis


INT64 = 2**63 - 1


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int64(v):
    """`v` with its numbers inside int64, as the schema has them: schemathesis draws integers near
    2**63 through doubles and overshoots the bound there (9223372036854775999 for a positive case
    of at most 2**63 - 1)."""
    if isinstance(v, list):
        return [_int64(x) for x in v]
    return max(-INT64 - 1, min(INT64, v)) if number(v) else v


def _served(ctx, case, kwargs) -> None:
    """schemathesis' before_call hook: what the schema cannot know, from the server serving SmolLM2:
    the served model's name (so that examples reach generation instead of stopping at 404: an unknown
    model is tested above), token ids within its vocabulary, and short outputs that fit its context
    (min_tokens within them); and numbers inside int64 (_int64). schemathesis checks an edited case
    again: one the hook made valid is judged as valid."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key, value in body.items():
        body[key] = _int64(value)
    if "model" in body:
        body["model"] = MODEL
    for key in ("prompt", "tokens"):  # ids (a list of them, or a list holding one list)
        ids = body.get(key)
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        if isinstance(ids, list):
            ids[:] = [int(t) % VOCAB if number(t) and t >= VOCAB else t for t in ids]
    if not case.path.startswith(("/v1/completions", "/v1/chat/completions")):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if number(body.get(key)) and body[key] > 4:
            body[key] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # completions default to 16, chat to the whole context
    cap = body.get("max_completion_tokens") if case.path.startswith("/v1/chat") else None
    cap = cap if cap is not None else body.get("max_tokens")
    if number(body.get("min_tokens")) and number(cap) and body["min_tokens"] > cap:
        body["min_tokens"] = cap


def _served_unless_the_tokenizer_refuses(ctx, response, case):
    """schemathesis' positive_data_acceptance but for the two refusals the schema cannot state, as
    they depend on the tokenizer: a prompt longer than the context, and a text it gives no tokens
    for (SmolLM2's drops some control characters whole: "\x06")."""
    from schemathesis.specs.openapi import checks as oas

    if response.status_code == 400 and response.json()["error"]["code"] in ("context_length_exceeded",
                                                                            "empty_prompt"):
        return None
    return oas.positive_data_acceptance(ctx, response, case)


def test_schemathesis_finds_no_server_errors_and_answers_as_the_schema_says(server):
    """Positive and negative cases for every operation: no 5xx; the status, content type, headers
    and body (each event of a stream too) of every answer are the ones the schema documents; a case
    the schema takes is answered 2xx (unless its prompt is longer than the context, or its text gives
    no tokens). Not checked:
    that every case the schema refuses gets a 4xx.
    As vLLM's, the server parses JSON as pydantic's lax mode does: true for 1, "4" for 4, 0 for false
    (in the schema, only the strict types)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.hooks import GLOBAL_HOOK_DISPATCHER
    from schemathesis.specs.openapi import checks as oas

    checks = [not_a_server_error, oas.status_code_conformance, oas.content_type_conformance,
              oas.response_headers_conformance, oas.response_schema_conformance,
              _served_unless_the_tokenizer_refuses]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    schemathesis.hook("before_call")(_served)
    try:
        for op in ops:
            post = op.method.upper() == "POST"
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                if not op.body and mode is schemathesis.GenerationMode.NEGATIVE:
                    continue  # GET routes and POST /flush_cache take no input to get wrong

                @settings(max_examples=20 if post else 3, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                @given(case=op.as_strategy(mode))
                def check(case):
                    r = case.call(base_url=server.url, headers=AUTH, timeout=120)
                    case.validate_response(r, checks=checks)
                    if r.status_code >= 400 and case.path.startswith("/v1") and case.method.upper() != "HEAD":
                        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

                check()
    finally:
        GLOBAL_HOOK_DISPATCHER.unregister(_served)
    still_answers(server)
