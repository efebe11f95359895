"""The tokens a check runs on: verify's prompt (or a fixed spread of ids for a checkpoint without a
tokenizer) and the unseen text the quantization effect is measured over."""

from __future__ import annotations

from pathlib import Path

from ..compile import Model
from ..errors import CheckpointError, InputError
from ..tokenizer import Tokenizer

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Python's documentation says that"
# The opening of *Pride and Prejudice*, which the embedded model never saw.
UNSEEN_TEXT = Path(__file__).resolve().parent.parent / "data" / "unseen_text.txt"


def has_tokenizer(folder: Path) -> bool:
    """A checkpoint folder with tokenizer files, or a GGUF (which carries its vocabulary)."""
    return folder.is_file() or (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def prompt_ids(model: Model, prompt: str | None) -> list[int]:
    """The prompt's ids; a broken tokenizer, or ids the model has no embedding for, are errors."""
    if not has_tokenizer(model.path):
        if prompt:
            raise InputError(f"{model.path} has no tokenizer, so a text prompt cannot be encoded")
        # Without a tokenizer, a fixed spread of ids in the vocabulary stands in for text.
        return [(17 * i + 3) % model.spec.vocab_size for i in range(12)]
    ids = Tokenizer(model.path).encode(prompt or DEFAULT_PROMPT)  # CheckpointError names a broken file
    outside = sorted({i for i in ids if not 0 <= i < model.spec.vocab_size})
    if outside:
        raise CheckpointError(
            f"{model.path}: the tokenizer gives ids {', '.join(map(str, outside[:5]))} that the model's vocabulary "
            f"of {model.spec.vocab_size} does not have",
            hint="the tokenizer and the weights do not belong together; pass --prompt text the model can take",
        )
    return ids


def text_ids(model: Model, limit: int) -> tuple[str, list[int]]:
    """The unseen text's ids (at most `limit`), or the verify prompt's fixed ids without a tokenizer."""
    if not has_tokenizer(model.path):
        return "fixed ids (no tokenizer)", prompt_ids(model, None)[:limit]
    ids = Tokenizer(model.path).encode(UNSEEN_TEXT.read_text())
    return "unseen text", [i for i in ids if 0 <= i < model.spec.vocab_size][:limit]
