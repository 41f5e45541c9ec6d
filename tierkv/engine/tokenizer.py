"""Text <-> token ids for the engine: a thin wrapper over a local Hugging Face tokenizer.

It adds what the engine needs on top: the set of end-of-sequence ids (tokenizer and
generation_config.json together), the chat template, and incremental detokenization for
streaming and stop strings. It reads only local files and never downloads anything.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template."""
        if not getattr(self.hf, "chat_template", None):
            raise ConfigError(
                "this model's tokenizer has no chat template; use generate() with plain prompts, "
                "or add a chat_template to its tokenizer_config.json"
            )
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as err:  # the template's own check (roles must alternate, ...): the caller's to fix
            raise ConfigError(f"the chat template refused these messages: {err}") from None
        # the template already wrote BOS and friends; do not add them twice
        return self.encode(text, add_special_tokens=False)


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
