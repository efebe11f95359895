"""A checkpoint's `tokenizer.json` as llama.cpp's GGUF vocabulary.

Two shapes cover the supported families: byte-level BPE (`tokenizer.ggml.model = gpt2`, with
merges and the pre-tokenizer's name, since llama.cpp splits text by a regex it picks by name)
and SentencePiece-style BPE with byte fallback (`llama`, scores that order the merges).
Anything else is refused by name rather than written as a vocabulary that tokenizes differently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnsupportedModel

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp picks its pre-tokenizer regex by name; these are the Split patterns each name means.
# (The names, like the vocabulary types "gpt2" and "llama" below, are GGUF's tokenizer identifiers.)
PRE_TOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class GgufVocab:
    model: str  # "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    pre: str | None = None
    add_space_prefix: bool | None = None
    merges: list[str] = field(default_factory=list)


def _walk(node) -> list[dict]:
    """A pre-tokenizer / normalizer and the members of any Sequence in it, flattened."""
    if not isinstance(node, dict):
        return []
    inner = node.get("pretokenizers") or node.get("normalizers") or []
    return [node] + [n for child in inner for n in _walk(child)]


def _pre_name(tj: dict) -> str:
    parts = _walk(tj.get("pre_tokenizer"))
    splits = [p["pattern"].get("Regex") for p in parts if p.get("type") == "Split" and isinstance(p.get("pattern"), dict)]
    if not splits and any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "gpt-2"
    for name, pattern in PRE_TOKENIZERS.items():
        if splits == [pattern]:
            return name
    raise UnsupportedModel(
        "the tokenizer's pre-tokenizer is not one llama.cpp knows by name (known: gpt-2, "
        + ", ".join(PRE_TOKENIZERS) + ")",
        hint="llama.cpp would split text differently from the checkpoint's tokenizer")


def _merge_ranks(merges: list) -> dict[str, int]:
    """Merged piece -> rank of the merge that makes it (the first merge that makes it wins)."""
    ranks: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ranks.setdefault(a + b, rank)
    return ranks


def read_vocab(folder: Path, vocab_size: int) -> GgufVocab:
    """The tokenizer in `folder`, padded with unused `[PAD{i}]` tokens to the model's vocabulary size."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModel(f"{folder} has no tokenizer.json, and a GGUF carries its vocabulary",
                               hint="add the checkpoint's tokenizer.json to the folder")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise UnsupportedModel(f"{path} is not a tokenizers JSON file") from None
    if model.get("type") != "BPE":
        raise UnsupportedModel(f"{path}: a {model.get('type')} tokenizer cannot be written as GGUF here "
                               "(supported: byte-level BPE, SentencePiece-style BPE)")
    pieces: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        pieces[i] = a["content"]
    top = max(pieces) + 1
    if top > vocab_size:
        raise UnsupportedModel(f"{path} has token ids up to {top - 1}, past the model's {vocab_size} embeddings")
    byte_level = any(p.get("type") == "ByteLevel" for p in _walk(tj.get("pre_tokenizer"))) or \
        (tj.get("decoder") or {}).get("type") == "ByteLevel"
    if not byte_level and not model.get("byte_fallback"):
        raise UnsupportedModel(f"{path}: a BPE tokenizer without byte-level encoding or byte fallback "
                               "has no GGUF equivalent here")
    unk = model.get("unk_token")
    tokens, types = [], []
    for i in range(vocab_size):
        text = pieces.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(text)
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif not byte_level and _BYTE_TOKEN.fullmatch(text):
            tokens.append(text)
            types.append(BYTE)
        else:
            tokens.append(text)
            types.append(UNKNOWN if text == unk else NORMAL)
    if byte_level:
        return GgufVocab("gpt2", tokens, types, pre=_pre_name(tj))
    # SentencePiece ranks merges by the merged piece's score: higher first, so -rank.
    ranks = _merge_ranks(model.get("merges") or [])
    scores = [-float(ranks.get(t, 0)) if types[i] == NORMAL else 0.0 for i, t in enumerate(tokens)]
    norms = _walk(tj.get("normalizer")) + _walk(tj.get("pre_tokenizer"))
    space_prefix = any(n.get("type") == "Prepend" or (n.get("type") == "Metaspace" and
                                                      n.get("prepend_scheme", "always") != "never") for n in norms)
    return GgufVocab("llama", tokens, types, scores=scores, add_space_prefix=space_prefix)


def vocab_from_gguf(voc) -> GgufVocab:
    """The vocabulary a GGUF carries (gguf.schema's Vocabulary, checked), to be written again (a GGUF
    model exported in another format)."""
    return GgufVocab(voc.model, list(voc.tokens), list(voc.types), scores=voc.scores, pre=voc.pre,
                     add_space_prefix=voc.add_space_prefix, merges=[f"{a} {b}" for a, b in voc.merges])
