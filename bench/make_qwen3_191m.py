"""The checkpoint the README's figures are measured on: a random float32 Qwen3 of 191M parameters.

    python bench/make_qwen3_191m.py /tmp/qwen3-191m      # then: linnet bench /tmp/qwen3-191m ...

hidden 1024, 8 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 3072, vocab 32000
(766 MB), written by transformers itself; random weights, so speed and distances are meaningful
and the text is not. A byte-level BPE tokenizer (Qwen2's pre-tokenizer, 2,000 tokens trained on
Python's own documentation, padded by the model's vocabulary as Qwen's is) and a ChatML chat template
(Qwen's) make it a complete checkpoint: exports carry them, llama.cpp reads them from the GGUF, and
`linnet verify --url` checks a server's chat template against it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(args.out)
    write_tokenizer(args.out)
    print(args.out)


def write_tokenizer(folder: Path) -> None:
    import json

    from pydoc_data.topics import topics
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(topics.values()), trainers.BpeTrainer(
        vocab_size=2000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    chatml = Path(__file__).resolve().parents[1] / "linnet_core" / "default_model" / "chat_template.jinja"
    (folder / "chat_template.jinja").write_text(chatml.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 4096}))


if __name__ == "__main__":
    main()
