"""The tokenizer a GGUF carries, rebuilt as a `tokenizers` tokenizer that splits text as llama.cpp does.

Two vocabulary types cover the supported families (the inverse of export.gguf_vocab):
- `gpt2`: byte-level BPE with the file's merges, text split first by the regex llama.cpp picks by
  the `tokenizer.ggml.pre` name (only names whose regex Linnet reproduces exactly are accepted);
- `llama`: SentencePiece-style BPE with byte fallback, merges ranked by the merged piece's score
  (llama.cpp merges the best-scoring adjacent pair first), `▁` for spaces and a prefix space.
Control tokens become special tokens and user-defined ones added tokens, each matched whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModel
from .reader import GGUFFile
from .vocab import BYTE, CONTROL, NORMAL, PRE_TOKENIZERS, USER_DEFINED

# llama.cpp's pre-tokenizer names -> the split regex each means (None: GPT-2's own, ByteLevel's regex).
# The aliases are the names llama.cpp maps onto the same regex as the key they point to.
PRE_NAMES: dict[str, str | None] = {
    "gpt-2": None,
    "qwen2": PRE_TOKENIZERS["qwen2"], "deepseek-r1-qwen": PRE_TOKENIZERS["qwen2"],
    "llama-bpe": PRE_TOKENIZERS["llama-bpe"], "llama3": PRE_TOKENIZERS["llama-bpe"],
    "llama-v3": PRE_TOKENIZERS["llama-bpe"],
}
# llama.cpp takes a word whole when it is in the vocabulary, before any merge, for these (Llama 3's).
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")


@dataclass
class GgufTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None


def _special(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two vocabulary pieces, best-scoring merged piece first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for merged, i in vocab.items():
        for k in range(1, len(merged)):
            a, b = merged[:k], merged[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def tokenizer_from_gguf(meta: dict[str, Any]) -> GgufTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise UnsupportedModel("the GGUF carries no vocabulary (tokenizer.ggml.tokens)", hint="pass token ids instead")
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        if pre not in PRE_NAMES:
            raise UnsupportedModel(f"the GGUF's pre-tokenizer '{pre}' is not one Linnet reproduces exactly "
                                   f"(reproduces: {', '.join(PRE_NAMES)})", hint="use the Hugging Face checkpoint")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
        split = PRE_NAMES[pre]
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        # llama.cpp adds BOS to Llama 3's vocabulary unless the file says otherwise, to others not.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in IGNORE_MERGES))
    elif kind == "llama":
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
        unk = _special(meta, tokens, "unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                                   byte_fallback=any(t == BYTE for t in types), fuse_unk=True))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        spaces = [normalizers.Replace(" ", "▁")]
        tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else []) + spaces)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1 if prefix else 0, 0)])
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise UnsupportedModel(f"the GGUF's tokenizer type '{kind}' is not supported (supported: gpt2, llama)",
                               hint="pass token ids instead")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    bos = _special(meta, tokens, "bos_token_id")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, vocab[bos])])
    template = meta.get("tokenizer.chat_template")
    return GgufTokenizer(tok, bos, _special(meta, tokens, "eos_token_id"),
                         template if isinstance(template, str) else None)


def write_tokenizer_files(gguf: Path, dst: Path) -> None:
    """`tokenizer.json` and `tokenizer_config.json` in `dst` for the tokenizer the GGUF carries."""
    with GGUFFile(gguf) as g:
        built = tokenizer_from_gguf(g.metadata)
    built.tokenizer.save(str(dst / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": built.bos_token, "eos_token": built.eos_token}
    if built.chat_template:
        config["chat_template"] = built.chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2) + "\n")
