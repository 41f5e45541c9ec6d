"""What tierkv-serve takes and refuses: bad input (malformed JSON, wrong fields, prompts past the
context, a missing or wrong API key, unknown routes and methods) gets an OpenAI-shaped error that
says what to change, and the server keeps answering; its OpenAPI schema refuses a body exactly when
the server does (edge cases checked with jsonschema); schemathesis' positive and negative cases for
every operation get no 5xx and only answers the schema documents. One SmolLM2 server for the
module, set up as test_server.py's (smol_server.py).
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
import smol_server
from smol_server import AUTH, CONTEXT, KEY, MODEL, VOCAB, assert_error, post, still_answers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from smol_server.start(tmp_path_factory)


# ---------------------------------------------------------------------------- bad input

LONG = "word " * (CONTEXT + 50)
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 1}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": CONTEXT}, 400, "max_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0].rsplit('/', 1)[1]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_answering(server, path, body, status, param):
    assert_error(post(server, path, body), status, param)
    still_answers(server)


def test_a_long_token_id_prompt_is_checked_whole(server):
    """A token-id prompt's checks run on the event loop (no hop to the tokenizing thread), and still
    cover every id: one past the vocabulary at the end of a context-long prompt, a negative one, and
    one id too many for the context each get a 400 that says what to change; the same ids within
    bounds are served."""
    ids = [(7 * i) % VOCAB for i in range(CONTEXT - 2)]  # room for one output token
    body = {"model": MODEL, "max_tokens": 1}
    err = assert_error(post(server, "/v1/completions", {**body, "prompt": ids[:-1] + [VOCAB]}), 400)
    assert f"[0, {VOCAB})" in err["message"]
    assert_error(post(server, "/v1/completions", {**body, "prompt": ids[:-1] + [-1]}), 400, "prompt")
    err = assert_error(post(server, "/v1/completions", {**body, "prompt": ids + [1, 2]}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and f"has {CONTEXT} tokens" in err["message"]
    r = post(server, "/v1/completions", {**body, "prompt": ids})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_text_prompt_the_tokenizer_gives_no_tokens_for_gets_a_400_that_says_so(server):
    # SmolLM2's tokenizer drops "\x06" whole: a prompt the schema takes (not empty), yet no token;
    # the engine's own refusal ("the prompt is empty") would blame the client for an empty prompt
    err = assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "\x06", "max_tokens": 1}), 400,
                       "prompt")
    assert err["code"] == "empty_prompt" and "gives no tokens with this model's tokenizer" in err["message"]
    still_answers(server)


def test_api_key_guards_every_v1_route_but_not_health(server):
    routes = [("GET", "/v1/models"), ("GET", "/v1/cache/stats"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("GET", "/v1/nowhere")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in routes:
            r = httpx.request(method, server.url + path, headers=headers, content=b"{not json", timeout=30)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key" and KEY not in r.text
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_unknown_route_is_404_in_openai_shape(server):
    assert_error(httpx.get(server.url + "/v1/nowhere", headers=AUTH, timeout=30), 404)


def test_a_wrong_method_is_405_naming_the_allowed_ones(server):
    r = httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=30)
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    r = httpx.post(server.url + "/health", timeout=30)
    assert r.status_code == 405 and sorted(r.headers["allow"].split(", ")) == ["GET", "HEAD"]


def test_a_refused_field_names_the_value_to_send_in_json(server):
    for field, value in (("prompt_logprobs", 1), ("echo", True), ("response_format", {"type": "json_object"})):
        err = assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", field: value}), 400, field)
        assert "None" not in err["message"] and "True" not in err["message"] and "False" not in err["message"]
    err = assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 2}}), 400)
    assert "send null" in err["message"]


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
