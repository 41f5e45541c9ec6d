"""Text <-> token ids for the engine: a thin wrapper over a local Hugging Face tokenizer.

It adds what the engine needs on top: the set of end-of-sequence ids (tokenizer and
generation_config.json together), the chat template, a lower bound on a text's token count that
needs no tokenizing, and incremental detokenization for streaming and stop strings. It reads only
local files and never downloads anything.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# Normalizers that never leave fewer characters than they were given (Replace only when it puts in
# at least as many as it takes out), and those that compose (NFC, NFKC): at most this many
# characters into one, U+1F82's four being the longest canonical decomposition (tests check it
# against unicodedata). Any other (Strip, StripAccents, Nmt, Precompiled, BertNormalizer) can drop
# characters, and no bound is taken from the text's length.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
MAX_COMPOSED = 4
# Pre-tokenizers that split without dropping anything; Whitespace, WhitespaceSplit, BertPreTokenizer
# and CharDelimiterSplit drop what they split on, and a Split or Punctuation "removed" drops its matches.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts",
                           "FixedLength"}


class Tokenizer:
    """Encode, decode and chat-template with one model's tokenizer."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load tokenizer.json / tokenizer_config.json (and its chat template) from a model dir;
        None when the directory has no tokenizer (random-weight benchmark models)."""
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
            log.warning("%s has no tokenizer; only token-id prompts can be used", model_dir)
            return None
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        eos: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            eos += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if hf.eos_token_id is not None:
            eos.append(hf.eos_token_id)
        if not eos:
            log.warning("%s names no eos token; generation stops only at max_tokens or stops", model_dir)
        return cls(hf, sorted(set(int(t) for t in eos)))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def length_bound(self) -> LengthBound | None:
        """How few tokens a text can make, from its length (see LengthBound); None when there is
        no such bound: a tokenizer that can drop any character, or make one token of a run of any
        length."""
        return LengthBound.of(self.hf)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from the text's length alone (0 when there is none):
        enough to refuse a text far too long for a context without paying for its tokenizing."""
        bound = self.length_bound
        if bound is None:
            return 0
        # one C pass (~0.7 ms a MB), rather than a count of each dropped character
        kept = len(text.translate(str.maketrans("", "", bound.dropped))) if bound.dropped else len(text)
        return -(-kept // bound.chars_per_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template."""
        # the template already wrote BOS and friends; do not add them twice
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The text of `messages` rendered with the model's chat template, special tokens written
        out (encode it with add_special_tokens=False)."""
        if not getattr(self.hf, "chat_template", None):
            raise ConfigError(
                "this model's tokenizer has no chat template; use generate() with plain prompts, "
                "or add a chat_template to its tokenizer_config.json"
            )
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as err:  # the template's own check (roles must alternate, ...): the caller's to fix
            raise ConfigError(f"the chat template refused these messages: {err}") from None


@dataclass(frozen=True, slots=True)
class LengthBound:
    """The most characters of a text one of its tokens can stand for, and the characters that make
    no token at all: a text of n characters, d of them droppable, has at least (n - d) /
    chars_per_token tokens, so a prompt far past the context can be refused without tokenizing it.

    That holds when every other character ends up in some token: the normalizer and the
    pre-tokenizer drop none, and no run of unknown characters becomes one token (byte-level BPE,
    byte fallback, or one unknown token a character). A token then covers at most as many
    characters as its own text has: a byte-level token's text has one character a byte, and a
    character is at least a byte; a SentencePiece piece is the text it covers ("<0x41>" covers
    one); an added token is matched whole. A normalizer that composes (NFC) can make one character
    of up to MAX_COMPOSED, so chars_per_token is that many times the longest token's text.
    """

    chars_per_token: int
    dropped: str = ""  # characters whose bytes a byte-level vocabulary lacks: they vanish

    @classmethod
    def of(cls, hf: Any) -> LengthBound | None:
        """Read from a fast tokenizer's spec (tokenizer.json); None when the above does not hold."""
        if not getattr(hf, "is_fast", False):
            return None
        spec = json.loads(hf.backend_tokenizer.to_str())
        model = spec["model"]
        normalizers, pre_tokenizers = _parts(spec.get("normalizer")), _parts(spec.get("pre_tokenizer"))
        for n in normalizers:
            replace_shrinks = n["type"] == "Replace" and (
                "String" not in n["pattern"] or len(n["content"]) < len(n["pattern"]["String"]))
            if replace_shrinks or n["type"] not in _KEEPING_NORMALIZERS | _COMPOSING_NORMALIZERS | {"Replace"}:
                return None
        if any(p["type"] not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre_tokenizers):
            return None
        if model["type"] not in ("BPE", "Unigram"):
            return None  # WordPiece and WordLevel make one unknown token of a whole word of any length
        pieces = list(model["vocab"]) if model["type"] == "BPE" else [piece for piece, _ in model["vocab"]]
        vocab = set(pieces)
        dropped = ""
        if any(p["type"] == "ByteLevel" for p in pre_tokenizers):
            dropped = _bytes_missing(vocab)
            if dropped is None:
                return None
        elif not (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))):
            if model["type"] == "Unigram" or not model.get("unk_token") or model.get("fuse_unk"):
                return None  # unknown characters are dropped, or a run of them is one token
        added = spec.get("added_tokens") or []
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None  # such a token takes in the whitespace beside it, however long
        longest = max(map(len, [*pieces, *(t["content"] for t in added)]), default=1)
        composes = any(n["type"] in _COMPOSING_NORMALIZERS for n in normalizers)
        return cls(longest * (MAX_COMPOSED if composes else 1), dropped)


def _bytes_missing(vocab: set[str]) -> str | None:
    """The characters a byte-level BPE drops: those whose every byte's symbol its vocabulary lacks
    (SmolLM2 lacks six ASCII control characters'). A character of several bytes is kept while its
    continuation bytes are (0x80-0xBF, in every such character); None when one of those is missing."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = ByteLevel(add_prefix_space=False, use_regex=False)

    def symbol(char: str) -> str:  # the byte-level text of `char`: one symbol a UTF-8 byte
        return symbols.pre_tokenize_str(char)[0][0]

    if any(symbol(chr(c))[1] not in vocab for c in range(0x80, 0xC0)):  # 0xC2, then the continuation byte c
        return None
    return "".join(chr(b) for b in range(0x80) if symbol(chr(b)) not in vocab)


def _parts(component: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer spec as the list of its parts (a Sequence's, flattened)."""
    if component is None:
        return []
    if component["type"] == "Sequence":
        inner = component.get("normalizers", component.get("pretokenizers", []))
        return [part for c in inner for part in _parts(c)]
    return [component]


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    Decoding a token alone loses context (SentencePiece drops a leading space, a multi-byte
    character can span tokens), so each step decodes a short window of earlier tokens with and
    without the new ones and emits the difference, holding back text that ends in an
    incomplete character (U+FFFD).
    """

    # prompt tokens kept as context so the first output token decodes with its leading space
    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (maybe "" while a character is split)."""
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        after = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
