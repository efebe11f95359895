"""Train the small model that ships inside Linnet (linnet_core/default_model/).

It is a 4-layer Llama-family decoder with a byte-level BPE vocabulary, trained on text that every
CPython install carries offline: the reference topics in `pydoc_data` and the docstrings of the
standard library (read with `ast`, never imported). The point is a fresh install that answers
`linnet run --prompt ...` with words, not a useful model.

    python scripts/train_default_model.py --steps 3000 --out linnet_core/default_model
"""

from __future__ import annotations

import argparse
import ast
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus(max_chars: int) -> list[str]:
    """Offline English text: pydoc topics, then standard-library docstrings."""
    import pydoc_data.topics

    texts = [t.strip() for t in pydoc_data.topics.topics.values()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2:] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    texts.append(doc.strip())
        if sum(map(len, texts)) > max_chars:
            break
    return texts


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("linnet_core/default_model"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-chars", type=int, default=3_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = corpus(args.max_chars)
    tokenizer = train_tokenizer(texts, args.out)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"] + [eos])
    data = torch.tensor(ids, dtype=torch.long)
    print(f"corpus: {sum(map(len, texts)):,} chars, {len(data):,} tokens", flush=True)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - args.seq - 1, (args.batch,))
        batch = torch.stack([data[o : o + args.seq + 1] for o in offsets.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # labels are shifted inside the model; feed the same window as inputs
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.time() - start:6.0f}s", flush=True)

    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(args.out)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
