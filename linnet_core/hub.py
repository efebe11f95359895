"""Model resolution: a local checkpoint folder, a Hugging Face repo id, or a short name.

Repo ids go through `huggingface_hub` and its cache (`HF_HOME`, `HF_HUB_OFFLINE`, revisions).
The local cache is tried first without touching the network; only what Linnet reads is fetched
(configs, tokenizer files, safetensors), never pickle weights.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFound
from .models.catalog import SHORT_NAMES

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
DEFAULT_MODEL_NAME = "linnet-default"
FETCH_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user typed (or the default's name)
    path: Path  # the checkpoint folder, or a GGUF file
    repo_id: str | None = None
    revision: str | None = None


def fetch_command(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    includes = " ".join(f"'{p}'" for p in FETCH_PATTERNS)
    return f"hf download {repo_id}{rev} --include {includes}"


def resolve(model: str | os.PathLike | None, revision: str | None = None) -> ResolvedModel:
    """Find the checkpoint folder (or GGUF file) for `model`; None means the model embedded in Linnet."""
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return ResolvedModel(DEFAULT_MODEL_NAME, DEFAULT_MODEL_DIR)
    text = str(model)
    local = Path(text).expanduser()
    if local.is_dir():
        return ResolvedModel(text, local.resolve())
    if local.is_file() and local.suffix.lower() == ".gguf":
        return ResolvedModel(text, local.resolve())
    if local.exists():
        raise ModelNotFound(f"'{text}' is a file; a model is a checkpoint folder, a .gguf file, a repo id or a "
                            "short name")
    repo_id = SHORT_NAMES.get(text.lower(), text)
    if not _REPO_ID.match(repo_id) or text.startswith((".", "/", "~")):
        raise ModelNotFound(
            f"no model '{text}': not a folder, a Hugging Face repo id or a known short name",
            hint=f"short names: {', '.join(SHORT_NAMES)}",
        )
    return ResolvedModel(text, _snapshot(repo_id, revision), repo_id, revision)


def hf_cache_dir() -> str | None:
    """The hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    kw = dict(revision=revision, allow_patterns=FETCH_PATTERNS, cache_dir=hf_cache_dir())
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kw))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, HfHubHTTPError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline:
        try:
            return Path(snapshot_download(repo_id, **kw))
        except Exception as e:  # network, auth, unknown repo: all end in the same advice
            reason = type(e).__name__
        else:  # pragma: no cover - returned above
            reason = ""
    else:
        reason = "HF_HUB_OFFLINE is set"
    raise ModelNotFound(
        f"model '{repo_id}' is not in the local Hugging Face cache and could not be fetched ({reason})",
        hint=f"fetch it with: {fetch_command(repo_id, revision)}",
    )


def is_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds this repo's config (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hf_cache_dir())
    return isinstance(found, str)
