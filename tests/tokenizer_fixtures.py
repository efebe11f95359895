"""Tiny trained tokenizers in the two shapes decoder checkpoints ship, for the export round trips.

- byte-level BPE (GPT-2 bytes, a Split regex as Qwen2 or Llama 3 write it), vocabulary padded
  by the model as Qwen's is;
- SentencePiece-style BPE (`▁` for spaces, `<0xXX>` byte fallback, `<unk>`/`<s>`/`</s>` first)
  as Llama 2, Mistral and Phi-3 convert to `tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! The list object is a mutable sequence of items.",
    "Python's documentation says that a dictionary maps keys to values.",
    "Numbers like 123 and 4567 are split into digits; quotes \"like this\" too.",
    "Indented lines:\n    return x + y\n\tand tabs.",
] * 4
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INST = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def byte_level(vocab_size: int, split: str, specials: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(specials)
    return tok


def sentencepiece_style(vocab_size: int):
    """Trained merges over `▁`-joined words, with llama's fixed ids: <unk> 0, <s> 1, </s> 2, bytes 3..258."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    probe = Tokenizer(models.BPE())
    probe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    probe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size - len(head), show_progress=False))
    trained = json.loads(probe.to_str())["model"]
    pieces = sorted(trained["vocab"], key=trained["vocab"].get)
    vocab = {t: i for i, t in enumerate(head + [p for p in pieces if p not in head])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


STYLES = {
    # style: (builder, tokenizer_config fields)
    "qwen2": (lambda v: byte_level(v - 16, QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}),
    "llama3": (lambda v: byte_level(v - 16, LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>"]),
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": CHATML}),
    # Phi-3's successors ship byte-level BPE with Phi-3's chat tokens and none of <s>, </s>, <unk>.
    "phi-bpe": (lambda v: byte_level(v - 16, LLAMA3_SPLIT, ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]),
                {"eos_token": "<|end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    "spm": (sentencepiece_style, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                  "chat_template": INST}),
}


def write_tokenizer(folder: Path, style: str, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json; the model's ids for bos/eos are set to match."""
    build, fields = STYLES[style]
    tok = build(vocab_size)
    assert tok.get_vocab_size() <= vocab_size, (style, tok.get_vocab_size())
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, "clean_up_tokenization_spaces": False,
           **{k: v for k, v in fields.items() if v is not None}}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        if fields.get(key):  # a pad id the case set itself (Phi-3 needs one) stays
            config[f"{key}_id"] = tok.token_to_id(fields[key])
    config_path.write_text(json.dumps(config, indent=2))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        gen.update({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None})
        gen_path.write_text(json.dumps(gen, indent=2))
