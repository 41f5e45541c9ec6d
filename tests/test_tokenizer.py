"""Tokenizer.fewest_tokens: a lower bound on a text's token count from its length alone.

The server refuses a prompt far too long for the context from this bound, before tokenizing it
(issue 37 item 4), so the bound must never be above the real count: a prompt that fits must never
be refused. Checked on the bundled SmolLM2 (byte-level BPE) and on tokenizers of the other kinds
models ship, built here with the `tokenizers` library, against texts made to be worst cases (the
longest tokens repeated, special tokens, characters that compose) and against random text.
"""

from __future__ import annotations

import json
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models import bundled_cache_dir
from tierkv.engine.loader import bundled_model_dir
from tierkv.engine.tokenizer import MAX_COMPOSED, Tokenizer

CORPUS = ["the cache holds blocks of keys and values", "élan, café, naïve: déjà vu", "数据 缓存 块",
          "a  b   c    d", "x = [1, 2, 3]; y = {'k': 'v'}", "\U0001F600 emoji \U0001F680 rocket"] * 20


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_dir(bundled_model_dir(bundled_cache_dir()))


def built(tmp_path, kind: str) -> Tokenizer:
    """A small fast tokenizer of one kind models ship, trained on CORPUS, saved and loaded as a
    model directory's is."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|im_start|>"]
    if kind == "sentencepiece":  # Llama 2 / Mistral: "▁" for spaces, the bytes of what the vocabulary lacks
        spaced = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        base = Fast(models.BPE(unk_token="<unk>"))
        base.normalizer = spaced
        base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
        learnt = json.loads(base.to_str())["model"]
        vocab = {**{f"<0x{b:02X}>": b for b in range(256)},
                 **{piece: 256 + i for i, piece in enumerate(learnt["vocab"])}}
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
        tok = Fast(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = spaced
        trainer = None
    elif kind == "nfc":  # Qwen 2: byte-level BPE after NFC, which composes characters
        tok = Fast(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "strip":  # a normalizer that drops characters: no bound can come from the length
        tok = Fast(models.BPE())
        tok.normalizer = normalizers.Sequence([normalizers.Strip(), normalizers.NFC()])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "wordlevel":  # tests/load_helpers.py's: an unknown word of any length is one token
        tok = Fast(models.WordLevel({"w0": 0, "w1": 1}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = None
    else:
        raise ValueError(kind)
    if trainer is not None:
        tok.train_from_iterator(CORPUS, trainer)
    tok.decoder = decoders.ByteLevel() if kind in ("nfc", "strip") else None
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path)
    return Tokenizer.from_dir(tmp_path)


def worst_cases(tok: Tokenizer) -> list[str]:
    """Texts that pack the most characters into the fewest tokens, and some that do the opposite."""
    vocab = tok.hf.get_vocab()
    texts = sorted({tok.decode([i], skip_special_tokens=False) for i in vocab.values()}, key=len)[-20:]
    return [*(t * 50 for t in texts), "".join(texts) * 5, "<|im_start|>" * 300, "\n" + " " * 5000,
            "e\u0301" * 500 + "\u1f00\u0300\u0345" * 300, "\U0001F600" * 400, "word " * 2000, "\x06" * 3000 + "hi",
            "\x04\x06\x13\x14\x16\x1d\x00\x7f" * 500, ""]


def assert_bound_holds(tok: Tokenizer, text: str) -> None:
    count = len(tok.encode(text, add_special_tokens=False))
    assert tok.fewest_tokens(text) <= count, (text[:60], tok.fewest_tokens(text), count)


def test_the_bundled_tokenizer_has_a_bound_that_never_exceeds_the_count(smollm):
    # byte-level BPE: its longest token is "\n" and 80 spaces, so 81 characters a token at most;
    # its vocabulary lacks the bytes of six control characters, which vanish from any text
    assert smollm.length_bound.chars_per_token == 81
    assert smollm.length_bound.dropped == "\x04\x06\x13\x14\x16\x1d"
    assert smollm.encode("\x06" * 1000 + "hi") == smollm.encode("hi")
    for text in worst_cases(smollm):
        assert_bound_holds(smollm, text)
    # the prompt: 1,000,000 characters are at least 12,346 tokens, far past any context
    # of SmolLM2 (8192), without tokenizing them
    assert smollm.fewest_tokens("word " * 200_000) == 12_346


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_the_bound_never_exceeds_the_count_of_any_text(smollm, text):
    assert_bound_holds(smollm, text)


@pytest.mark.parametrize("kind", ["sentencepiece", "nfc"])
def test_other_kinds_of_tokenizer_get_a_bound_that_holds(tmp_path, kind):
    tok = built(tmp_path, kind)
    longest = max(len(piece) for piece in tok.hf.get_vocab())
    # a composing normalizer can make one character of four: the bound allows for it
    assert tok.length_bound.chars_per_token == longest * (MAX_COMPOSED if kind == "nfc" else 1)
    for text in [*worst_cases(tok), *CORPUS]:
        assert_bound_holds(tok, text)


@pytest.mark.parametrize("kind", ["strip", "wordlevel"])
def test_tokenizers_that_can_drop_or_merge_any_run_of_characters_get_no_bound(tmp_path, kind):
    tok = built(tmp_path, kind)
    assert tok.length_bound is None and tok.fewest_tokens("x" * 100_000) == 0
    # why: a run of any length can be one token, or none
    run = " " * 10_000 if kind == "strip" else "y" * 10_000
    assert len(tok.encode(run, add_special_tokens=False)) <= 1


def test_at_most_four_characters_compose_into_one():
    # MAX_COMPOSED: the longest canonical decomposition of a character NFC rebuilds (U+1F82)
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if unicodedata.normalize("NFC", unicodedata.normalize("NFD", chr(c))) == chr(c))
    assert longest == MAX_COMPOSED
