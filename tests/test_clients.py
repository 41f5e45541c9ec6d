"""Real client libraries against a real `tierkv-serve`: LangChain's ChatOpenAI and LlamaIndex's OpenAILike.

One server for the module (the bundled SmolLM2 on the CPU). Each test gives its calls a fresh, long
system prompt: the first call finds nothing cached, the later ones must read the shared prefix from
the cache, and the client must surface the server's `cached_tokens`. Outputs are greedy and exactly
MAX_TOKENS long (ignore_eos), so content and usage are exact. Never mocks a client or the server.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import operator
import uuid

import pytest
from server_helpers import ServerProcess

CLIENTS = ("langchain_openai", "llama_index.llms.openai_like", "llama_index.core.llms")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


for _name in ("fastapi", *CLIENTS):
    if not _installed(_name):
        pytest.skip(f"{_name} is not installed (pip install -e .[test,serve])", allow_module_level=True)

KEY = "sk-test-" + uuid.uuid4().hex
MODEL = "smol"
BLOCK = 16  # the server's default block size: hits come in whole blocks
MAX_TOKENS = 4
# Tokens a warm prompt may have beyond its cached prefix: the turn markers and a short question
# (16 at most here), plus the partial block at the end of the shared prefix (15 at most).
MAX_UNCACHED_TAIL = 32
# Questions start with different words, so two prompts share exactly the system prompt and the
# template tokens before the question: every warm call sees the same cached prefix.
QUESTIONS = ("Name one tier.", "Why cache prefixes?", "Define eviction.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    srv = ServerProcess(["--served-model-name", MODEL, "--l1", "128MiB", "--max-model-len", "512"],
                        log, env={"TIERKV_API_KEY": KEY})
    try:
        # The client libraries take seconds to import: do it while the server loads its model.
        for name in CLIENTS:
            importlib.import_module(name)
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


@pytest.fixture
def system() -> str:
    # fresh per test (the id comes first), so no other test can have cached it
    return f"Session {uuid.uuid4().hex}. " + "You answer questions about tiered KV caches in one short sentence. " * 6


def check_usage(prompt: int, completion: int, total: int, cached: int, *, warm: bool) -> None:
    assert completion == MAX_TOKENS and total == prompt + completion
    assert prompt > 60  # the system prompt alone is longer than that
    if warm:
        assert cached % BLOCK == 0 and prompt - MAX_UNCACHED_TAIL <= cached < prompt, (prompt, cached)
    else:
        assert cached == 0


# ---------------------------------------------------------------------------- LangChain


def test_langchain_invoke_stream_batch(server, system):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.url + "/v1", api_key=KEY, model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0, timeout=120, stream_usage=True, extra_body={"ignore_eos": True})
    chats = [[("system", system), ("human", q)] for q in QUESTIONS]

    def usage(msg, *, warm: bool) -> int:
        u = msg.usage_metadata
        check_usage(u["input_tokens"], u["output_tokens"], u["total_tokens"],
                    u["input_token_details"]["cache_read"], warm=warm)
        return u["input_token_details"]["cache_read"]

    first = llm.invoke(chats[0])
    assert isinstance(first.content, str) and first.content.strip()
    assert first.response_metadata["finish_reason"] == "length" and first.response_metadata["model_name"] == MODEL
    usage(first, warm=False)

    chunks = list(llm.stream(chats[1]))
    assert len([c for c in chunks if c.content]) > 1  # it really streamed
    assert sum(c.usage_metadata is not None for c in chunks) == 1  # usage once, not per chunk
    streamed = functools.reduce(operator.add, chunks)
    assert streamed.content.strip()
    shared = usage(streamed, warm=True)

    # batch answers in input order; greedy output does not depend on what was cached or batched
    out = llm.batch(chats)
    assert [m.content for m in out[:2]] == [first.content, streamed.content]
    assert all(isinstance(m.content, str) and m.content.strip() for m in out)
    cached = [usage(m, warm=True) for m in out]
    assert cached[2] == shared  # a new question: only the shared system prompt was cached
    assert min(cached[:2]) >= shared  # a repeated prompt may hit more than the shared prefix


# ---------------------------------------------------------------------------- LlamaIndex


def llama(server, *, chat: bool):
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        api_base=server.url + "/v1", api_key=KEY, model=MODEL, is_chat_model=chat, max_tokens=MAX_TOKENS,
        temperature=0, max_retries=0, timeout=120, context_window=512,
        additional_kwargs={"extra_body": {"ignore_eos": True}})


# LlamaIndex asks for no usage on a stream unless told; passed per call, as it is only valid there
STREAM_USAGE = {"stream_options": {"include_usage": True}}


def raw_usage(raw, *, warm: bool) -> int:
    """Check the usage of a raw OpenAI response (or final stream chunk) that LlamaIndex passes on."""
    u = raw.usage
    check_usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens,
                warm=warm)
    return u.prompt_tokens_details.cached_tokens


def test_llamaindex_chat_and_stream_chat(server, system):
    from llama_index.core.llms import ChatMessage

    llm = llama(server, chat=True)
    chats = [[ChatMessage(role="system", content=system), ChatMessage(role="user", content=q)] for q in QUESTIONS]

    first = llm.chat(chats[0])
    assert first.message.role == "assistant" and first.message.content.strip()
    assert first.raw.choices[0].finish_reason == "length" and first.raw.model == MODEL
    raw_usage(first.raw, warm=False)

    second = llm.chat(chats[1])
    shared = raw_usage(second.raw, warm=True)

    parts = list(llm.stream_chat(chats[1], **STREAM_USAGE))
    assert len([p for p in parts if p.delta]) > 1
    assert "".join(p.delta or "" for p in parts) == parts[-1].message.content == second.message.content
    assert [p.raw.usage is not None for p in parts].count(True) == 1 and parts[-1].raw.usage is not None
    assert raw_usage(parts[-1].raw, warm=True) >= shared  # the whole prompt repeats


def test_llamaindex_complete_and_stream_complete(server, system):
    llm = llama(server, chat=False)
    prompts = [f"{system}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]

    first = llm.complete(prompts[0])
    assert first.text.strip() and first.raw.choices[0].finish_reason == "length"
    assert first.raw.object == "text_completion"  # the completions route, not chat
    raw_usage(first.raw, warm=False)  # the chat test's prompts are templated: no shared tokens

    second = llm.complete(prompts[1])
    shared = raw_usage(second.raw, warm=True)

    parts = list(llm.stream_complete(prompts[1], **STREAM_USAGE))
    assert len([p for p in parts if p.delta]) > 1
    assert "".join(p.delta or "" for p in parts) == parts[-1].text == second.text
    assert [p.raw.usage is not None for p in parts].count(True) == 1 and parts[-1].raw.usage is not None
    assert raw_usage(parts[-1].raw, warm=True) >= shared  # the whole prompt repeats
