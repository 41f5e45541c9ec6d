"""min_tokens through the engine, token for token against transformers' greedy decoding with the
end-of-sequence and stop token ids banned (logits -inf) for the first min_tokens steps, as vLLM does.

The bundled SmolLM2 on the CPU (fp32), with transformers on the weights the engine converted.
LLM.generate keeps the next step launched before the last one's token is back, so the count of
tokens sampled includes one on its way: these runs go through that path.
"""

from __future__ import annotations

import pytest
import torch
from models import bundled_cache_dir

from tierkv import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]  # 7 tokens, then eos


@pytest.fixture(scope="module")
def smollm():
    llm = LLM(device="cpu", cache_dir=str(bundled_cache_dir()))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    from tierkv.engine.loader import bundled_model_dir

    path = bundled_model_dir(bundled_cache_dir())
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(model, ids: list[int], params: SamplingParams, eos: list[int]) -> list[int]:
    """Greedy decoding with vLLM's min_tokens rule; stops at an end token or max_tokens."""
    ends = {*params.stop_token_ids, *eos}
    out: list[int] = []
    while len(out) < params.max_tokens:
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        if len(out) < params.min_tokens:
            logits[list(ends)] = -torch.inf
        out.append(int(logits.argmax()))
        if out[-1] in ends:
            break
    return out


def test_min_tokens_is_transformers_with_the_end_banned(smollm, hf_model):
    tok = smollm.tokenizer
    ids = tok.apply_chat_template(QUESTION)
    free = smollm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in tok.eos_token_ids and len(free.token_ids) == 8
    stop_id = free.token_ids[2]  # a token the free answer has early on
    cases = [SamplingParams(temperature=0, max_tokens=14, min_tokens=10),
             SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0, max_tokens=14, min_tokens=1, stop_token_ids=[stop_id])]
    outs = smollm.generate([ids] * len(cases), cases)
    for params, out in zip(cases, outs):
        expected = reference(hf_model, ids, params, tok.eos_token_ids)
        assert out.token_ids == expected, params
        assert len(out.token_ids) >= params.min_tokens
    assert outs[0].token_ids[:7] == free.token_ids[:7] and outs[0].token_ids[7] not in tok.eos_token_ids
    assert outs[2].finish_reason == "stop" and outs[2].token_ids[-1] == stop_id  # banned only for the first token


def test_stop_strings_count_only_after_min_tokens(smollm):
    tok = smollm.tokenizer
    ids = tok.apply_chat_template(QUESTION)
    free = smollm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0]  # "2 + 2 = 4"
    cut = smollm.generate([ids], SamplingParams(temperature=0, max_tokens=16, stop="+"))[0]
    assert cut.text == "2 " and cut.finish_reason == "stop"
    held = smollm.generate([ids], SamplingParams(temperature=0, max_tokens=16, stop="+", min_tokens=4))[0]
    # the "+" came in the first 4 tokens: it does not stop the output, and nothing later matches
    assert held.token_ids == free.token_ids and held.finish_reason == "stop"
