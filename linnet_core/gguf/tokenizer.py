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

from ..errors import CheckpointError, UnsupportedModel
from .reader import GGUFFile
from .schema import Metadata, Vocabulary
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


SPLIT_BUDGET = 6_000_000  # characters of normal pieces a SentencePiece vocabulary may hold (spm_merges)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two vocabulary pieces, best-scoring merged piece first.
    Every split is tried (~1.3 us each here): a vocabulary whose normal pieces hold more than
    SPLIT_BUDGET characters (3x a 256k one's) is refused rather than worked through for minutes."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    splits = sum(len(t) for t in vocab)
    if splits > SPLIT_BUDGET:
        raise CheckpointError(f"the GGUF's tokenizer.ggml.tokens holds {splits} characters of normal pieces, more "
                              f"than the {SPLIT_BUDGET} Linnet rebuilds as merges")
    ranked = []
    for merged, i in vocab.items():
        for k in range(1, len(merged)):
            a, b = merged[:k], merged[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def read_vocabulary(g: GGUFFile) -> Vocabulary:
    """The file's vocabulary, checked (gguf.schema); refused in one line when it has none."""
    voc = Metadata(g).vocabulary()
    if voc is None:
        raise UnsupportedModel("the GGUF carries no vocabulary (tokenizer.ggml.tokens)", hint="pass token ids instead")
    return voc


def tokenizer_from_gguf(voc: Vocabulary) -> GgufTokenizer:
    """The tokenizer `voc` describes. The schema has checked its keys against one another; what the
    tokenizers library still refuses is one line naming the vocabulary, never a traceback."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens, types = voc.tokens, voc.types
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        if voc.model == "gpt2":
            pre = voc.pre or "gpt-2"
            if pre not in PRE_NAMES:
                raise UnsupportedModel(f"the GGUF's pre-tokenizer '{pre[:40]}' is not one Linnet reproduces exactly "
                                       f"(reproduces: {', '.join(PRE_NAMES)})", hint="use the Hugging Face checkpoint")
            tok = Tokenizer(models.BPE(vocab=vocab, merges=voc.merges, ignore_merges=pre in IGNORE_MERGES))
            split = PRE_NAMES[pre]
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else \
                pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tok.decoder = decoders.ByteLevel()
            # llama.cpp adds BOS to Llama 3's vocabulary unless the file says otherwise, to others not.
            add_bos = pre in IGNORE_MERGES if voc.add_bos is None else voc.add_bos
        else:  # "llama"
            scores = voc.scores or [0.0] * len(tokens)
            unk = None if voc.unknown is None else tokens[voc.unknown]
            tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                                       byte_fallback=any(t == BYTE for t in types), fuse_unk=True))
            prefix = True if voc.add_space_prefix is None else voc.add_space_prefix
            spaces = [normalizers.Replace(" ", "▁")]
            tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else []) + spaces)
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1 if prefix else 0, 0)])
            add_bos = True if voc.add_bos is None else voc.add_bos
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == CONTROL and t])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t])
        bos = None if voc.bos is None else tokens[voc.bos]
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                               special_tokens=[(bos, vocab[bos])])
    except BaseException as e:  # the library's own errors; a Rust panic (pyo3's) is a BaseException
        if isinstance(e, (UnsupportedModel, KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"the GGUF's vocabulary (tokenizer.ggml.tokens, token_type, merges) cannot be "
                              f"rebuilt as a tokenizer: {first}") from None
    return GgufTokenizer(tok, bos, None if voc.eos is None else tokens[voc.eos], voc.chat_template)


def write_tokenizer_files(gguf: Path, dst: Path) -> None:
    """`tokenizer.json` and `tokenizer_config.json` in `dst` for the tokenizer the GGUF carries."""
    with GGUFFile(gguf) as g:
        built = tokenizer_from_gguf(read_vocabulary(g))
    built.tokenizer.save(str(dst / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": built.bos_token, "eos_token": built.eos_token}
    if built.chat_template:
        config["chat_template"] = built.chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2) + "\n")
