"""Fetch a model from the Hugging Face Hub into the local hub cache, with huggingface_hub.

Only safetensors weights, config, tokenizer and generation-config files are fetched. This file
never fetches .bin, .pth or any other pickle: tierkv never unpickles, since unpickling runs code.
HF_HUB_OFFLINE, HF_TOKEN, HF_ENDPOINT and HF_HOME (or HF_HUB_CACHE) work as in huggingface_hub,
and the download shows huggingface_hub's tqdm bars. Every failure a user can fix becomes a
ModelLoadError that says what to do.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

from ..errors import ModelLoadError

log = logging.getLogger(__name__)

# Top-level files only (see IGNORE_PATTERNS): the loader reads nothing else.
ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
]
# fnmatch's * also matches "/", so "*.safetensors" alone would fetch every subfolder's copies;
# Mistral repos ship their weights twice, the second time as consolidated.safetensors.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]

# A model id on the Hub: "org/name" of letters, digits, -, _ and . (bare "name" ids are legacy)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class HubError(ModelLoadError):
    """A hub model id cannot be fetched; the message says why and what to do."""


def looks_like_repo_id(model: str) -> bool:
    """'org/name' (not a path that exists: the caller checked that first)."""
    return bool(_REPO_ID.match(model)) and not model.startswith(".")


def model_source(model: str | os.PathLike | None) -> str:
    """Where `model` comes from: "bundled" (None), "local" (a directory) or "hub" (an org/name id).
    Raises ModelLoadError for anything else. Opens no file and touches no network, so configs
    check it before any weight is read."""
    if model is None:
        return "bundled"
    path = Path(model).expanduser()
    if path.is_dir():
        return "local"
    if path.is_file():
        raise ModelLoadError(f"{path} is a file; pass the model directory that holds config.json and *.safetensors")
    if isinstance(model, str) and looks_like_repo_id(model):
        return "hub"
    raise ModelLoadError(
        f"model {str(model)!r}: no such directory, and not a Hugging Face hub id (org/name); pass a local "
        "model directory that holds config.json and *.safetensors, a hub id, or model=None for the bundled "
        "SmolLM2"
    )


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _settings() -> tuple[str | None, str | None, bool]:
    """(endpoint, cache_dir, offline), read from the environment now. huggingface_hub reads them
    once, when it is first imported, and importing tierkv imports it: a program (or notebook)
    that sets HF_HOME or HF_HUB_OFFLINE after `import tierkv` still gets what it asked for.
    Unset, each is left to huggingface_hub (same precedence: HF_HUB_CACHE, then HF_HOME/hub)."""
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache and os.environ.get("HF_HOME"):
        cache = os.path.join(os.environ["HF_HOME"], "hub")
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    offline = _is_true(flag) if flag is not None else bool(constants.HF_HUB_OFFLINE)
    return endpoint, (os.path.expanduser(cache) if cache else None), offline


def download(repo_id: str) -> Path:
    """The local snapshot directory of `repo_id`, fetched (only what tierkv reads) unless the
    hub cache already has it."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise HubError(f"loading the hub model {repo_id!r} needs the package 'huggingface_hub': "
                       "pip install huggingface_hub  (or pass a local model directory)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (  # not .errors: older huggingface_hub has no such module
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint, cache_dir, offline = _settings()
    where = endpoint or constants.ENDPOINT
    cache_shown = cache_dir or constants.HF_HUB_CACHE
    if not offline:
        log.info("fetching %s from %s into %s (safetensors, config and tokenizer files only)",
                 repo_id, where, cache_shown)
    try:
        path = Path(snapshot_download(
            repo_id, endpoint=endpoint, cache_dir=cache_dir, local_files_only=offline,
            allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
        ))
    # GatedRepoError is a RepositoryNotFoundError: it goes first
    except GatedRepoError:
        raise HubError(
            f"{repo_id!r} is a gated model on the Hugging Face Hub: accept its terms at {where}/{repo_id} "
            "while logged in, then set HF_TOKEN to a token of that account (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"model {repo_id!r} is neither a local directory nor a model on the Hugging Face Hub ({where}): "
            "check the id, or the path if you meant a local directory; a private model needs HF_TOKEN set "
            "to a token that can read it"
        ) from None
    except RevisionNotFoundError as err:
        raise HubError(f"{repo_id!r} on the Hugging Face Hub: {err}") from None
    except LocalEntryNotFoundError:  # no answer from the hub, and nothing (complete) in the cache
        if offline:
            raise HubError(
                f"HF_HUB_OFFLINE is set and {repo_id!r} is not in the local hub cache ({cache_shown}): "
                "unset HF_HUB_OFFLINE to download it, point HF_HOME at a cache that holds it, "
                "or pass a local model directory"
            ) from None
        raise HubError(
            f"cannot reach the Hugging Face Hub at {where} to fetch {repo_id!r}, and it is not in the local "
            f"hub cache ({cache_shown}): check the network (and HTTPS_PROXY or HF_ENDPOINT), or download it "
            "where there is network and copy that HF_HOME here with HF_HUB_OFFLINE=1"
        ) from None
    except HfHubHTTPError as err:  # e.g. 403 for a token without read access, 5xx when the hub is down
        status = err.response.status_code if err.response is not None else "an error"
        raise HubError(
            f"the Hugging Face Hub ({where}) answered {status} for {repo_id!r}: {str(err).strip()}; "
            "check HF_TOKEN's permissions, or retry later"
        ) from None
    if not any(path.glob("*.safetensors")):
        raise HubError(
            f"{repo_id!r} on the Hugging Face Hub has no *.safetensors weights; tierkv loads only "
            "safetensors (a .bin or .pth file is a pickle, and loading one can run code): use a repo that "
            "ships safetensors, or convert the checkpoint with transformers' "
            "save_pretrained(safe_serialization=True) and pass that directory"
        )
    return path
