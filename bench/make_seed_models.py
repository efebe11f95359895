"""Random-weight checkpoints with the exact configs of the reference pages' models.

    python bench/make_seed_models.py qwen3-4b /tmp/seeds/qwen3-4b          # 7.5 GB, ~1 min here
    python bench/make_seed_models.py all /tmp/seeds                        # one folder per model
    python bench/make_seed_models.py qwen3-4b /tmp/tiny --tiny             # the same family, 2 layers
    python bench/make_seed_models.py qwen3-30b-a3b /tmp/seeds/qwen3-30b-a3b-q4_0.gguf   # 17 GB, a GGUF
    python bench/make_seed_models.py qwen3-4b /tmp/seeds/qwen3-4b-agree --branch-scale 0.01      # a pair that
    python bench/make_seed_models.py qwen3-0.6b /tmp/seeds/qwen3-0.6b-agree --branch-scale 0.01  # agrees

Shapes, rope, tied/untied head and sliding window are those of the models' own config.json;
the weights are random (normal, std 0.02; norms 1), bfloat16, in Hugging Face's sharded layout,
so speed, memory and distances are meaningful and the text is not. Each shard is generated and
written on its own (peak memory about one shard), from the shapes of a model built on the meta
device. A trained tokenizer in the family's style (byte-level BPE for Qwen, SentencePiece-style
for Phi-3 and Mistral, the model's vocabulary padding it) makes each a complete checkpoint that
`run`, `export` and llama.cpp take.

`--branch-scale S` multiplies the layers' output projections (attention's and the MLP's) by S. With
S well below 1 the residual stream stays close to the current token's embedding, so a tied head
predicts from that token far more than from the random layers: two seeds written with the same
small S (a 4B target and a 0.6B draft, say) then agree on most greedy tokens, and S sets how often.
Speculative decoding's speed depends on its acceptance rate, which random weights put near 0; such
a pair measures it at real shapes with acceptance near 1 (S = 0.01) or in between (larger S). The
text is a few tokens repeated: a measure of cost, not of a trained pair's acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (config class, the config.json's fields, tokenizer style of tests/tokenizer_fixtures.py)
SEEDS = {
    "phi-3-mini-4k-instruct": ("Phi3Config", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=10000.0), sliding_window=2047,
        tie_word_embeddings=False, vocab_size=32064, hidden_act="silu", attention_bias=False, pad_token_id=32000,
    ), "spm"),
    "qwen3-4b": ("Qwen3Config", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, max_window_layers=36,
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0), sliding_window=None,
        use_sliding_window=False, tie_word_embeddings=True, vocab_size=151936, hidden_act="silu",
        attention_bias=False,
    ), "qwen2"),
    "mistral-7b-instruct-v0.3": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), sliding_window=None,
        tie_word_embeddings=False, vocab_size=32768, hidden_act="silu",
    ), "spm"),
    "gemma-2-2b-it": ("Gemma2Config", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=8192,
        rms_norm_eps=1e-6, sliding_window=4096, vocab_size=256000, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ), "spm"),
    "gemma-3-4b-it": ("Gemma3TextConfig", dict(  # the text model of gemma-3-4b-it, as Gemma3ForCausalLM
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=131072,
        rms_norm_eps=1e-6, sliding_window=1024, vocab_size=262208, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, pad_token_id=0,
        rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
    ), "spm"),
}
# The draft for qwen3-4b in the speculative-decoding bench: Qwen3-0.6B's sizes, the rest (tokenizer,
# vocabulary, rope, tied head) qwen3-4b's.
SEEDS["qwen3-0.6b"] = ("Qwen3Config", {**SEEDS["qwen3-4b"][1], **dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, max_window_layers=28)},
    "qwen2")
# Written directly as a GGUF of the given format (the bf16 checkpoint of Qwen3-30B-A3B would be 61 GB):
# name -> (config class, fields, tokenizer style, format).
GGUF_SEEDS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        max_window_layers=48, use_sliding_window=False, sliding_window=None, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), tie_word_embeddings=False,
        vocab_size=151936, hidden_act="silu", attention_bias=False,
    ), "qwen2", "q4_0"),
}
# --tiny: the same family and features at test size (the vocabulary stays: it sizes the head).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16)


def seed_config(name: str, tiny: bool = False):
    import transformers

    cls, fields, _ = SEEDS[name]
    fields = dict(fields)
    if tiny:
        mha = fields["num_key_value_heads"] == fields["num_attention_heads"]
        fields.update(TINY, num_key_value_heads=4 if mha else 2)
        if fields.get("sliding_window"):
            fields["sliding_window"] = 8
        if "max_window_layers" in fields:
            fields["max_window_layers"] = TINY["num_hidden_layers"]
        if "query_pre_attn_scalar" in fields:  # the query scale follows the head width, as the full model's
            fields["query_pre_attn_scalar"] = TINY["head_dim"]
    return getattr(transformers, cls)(**fields, dtype="bfloat16")


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, as save_pretrained writes them (a tied head left out)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def plan_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int, elem_bytes: int = 2) -> list[list[str]]:
    """Tensor names grouped into shards of at most `shard_bytes` (a bigger tensor gets one of its own)."""
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        n = elem_bytes
        for d in shape:
            n *= d
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


ROWS_PER_DRAW = 256  # rows drawn from one generator: the draws run on every core, the bytes stay fixed
BRANCH_OUTPUTS = ("o_proj.weight", "down_proj.weight")  # what --branch-scale multiplies


def random_tensor(name: str, shape: tuple[int, ...], branch_scale: float = 1.0):
    """Normal(0, 0.02) matrices, ones for norms, zeros for biases; seeded by the name and row block,
    so a checkpoint is the same bytes however it is sharded and on however many cores it is drawn.
    The layers' output projections are drawn with their std times `branch_scale`."""
    import torch

    if len(shape) == 1:
        return (torch.ones if "norm" in name else torch.zeros)(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    std = 0.02 * (branch_scale if name.endswith(BRANCH_OUTPUTS) else 1.0)

    def draw(start: int) -> None:  # a seeded generator draws serially; torch frees the GIL meanwhile
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{start}".encode()))
        out[start:start + ROWS_PER_DRAW].normal_(0.0, std, generator=g)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(draw, range(0, shape[0], ROWS_PER_DRAW)))
    return out


def write_seed(name: str, out: Path, tiny: bool = False, shard_gb: float = 2.0, branch_scale: float = 1.0) -> Path:
    return write_random_checkpoint(seed_config(name, tiny), out, SEEDS[name][2], shard_gb, branch_scale)


def write_random_checkpoint(config, out: Path, tokenizer: str | None = None, shard_gb: float = 2.0,
                            branch_scale: float = 1.0) -> Path:
    """A checkpoint of `config`'s shapes with random bfloat16 weights, one shard in memory at a time,
    and a trained tokenizer in the style `tokenizer` (tests/tokenizer_fixtures.py) when given;
    `branch_scale`: as --branch-scale."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    final, out = out, out.with_name(out.name + ".partial")  # renamed when complete: never half-written
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shapes = tensor_shapes(config)
    shards = plan_shards(shapes, int(shard_gb * 2**30))
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(n, shapes[n], branch_scale) for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out)
    if tokenizer:
        sys.path.insert(0, str(ROOT / "tests"))
        from tokenizer_fixtures import write_tokenizer

        write_tokenizer(out, tokenizer, config.vocab_size)  # sets the config's bos/eos ids to the tokenizer's
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)
    return final


class RandomCheckpoint:
    """Random tensors under a checkpoint's names, drawn when read (nothing of them on disk)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def get(self, name: str):
        return random_tensor(name, self.shapes[name])

    def release(self, name: str) -> None:
        pass


def write_gguf_seed(name: str, out: Path, tiny: bool = False) -> Path:
    """A GGUF of the seed's shapes in its format, written by Linnet's exporter from random weights drawn
    one tensor at a time: a config and tokenizer in a scratch folder, no checkpoint on disk."""
    import tempfile

    import transformers

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from linnet_core.compile import Model
    from linnet_core.export.gguf_export import write_gguf
    from linnet_core.hub import ResolvedModel
    from linnet_core.models import build_graph, read_config, spec_from_config
    from tokenizer_fixtures import write_tokenizer

    cls, fields, tokenizer, fmt = GGUF_SEEDS[name]
    fields = {**fields, **(dict(TINY, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=64, max_window_layers=2) if tiny else {})}
    config = getattr(transformers, cls)(**fields, dtype="bfloat16")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        folder = Path(scratch)
        config.save_pretrained(folder)
        write_tokenizer(folder, tokenizer, config.vocab_size)
        cfg = read_config(folder)
        spec = spec_from_config(cfg)
        shapes = {src: (p.shape[0] // len(p.parts), *p.shape[1:])
                  for _, p, layer in build_graph(spec).all_params() for src in p.sources(layer)}

        class RandomModel(Model):
            def checkpoint(self):
                return RandomCheckpoint(shapes)

        partial = folder / out.name
        write_gguf(RandomModel(ResolvedModel(name, folder), cfg, spec, ()), partial, fmt,
                   progress=lambda line: print(f"  {line}", flush=True))
        partial.rename(out)  # complete: never half-written under its name
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=[*SEEDS, *GGUF_SEEDS, "all"])
    ap.add_argument("out", type=Path, help="the checkpoint folder (with 'all': the folder of one per model)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: the family's features at test size")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard, GiB (default 2)")
    ap.add_argument("--branch-scale", type=float, default=1.0, metavar="S",
                    help="the layers' output projections times S: below 1, seeds written with the same S agree "
                         "on most greedy tokens (a draft/target pair for speculative decoding; default 1)")
    args = ap.parse_args()
    if not 0 < args.branch_scale <= 1:
        ap.error(f"--branch-scale must be above 0 and at most 1, got {args.branch_scale}")
    if args.branch_scale != 1 and (args.model not in SEEDS or not SEEDS[args.model][1]["tie_word_embeddings"]):
        tied = ", ".join(n for n, (_, fields, _) in SEEDS.items() if fields["tie_word_embeddings"])
        ap.error(f"--branch-scale needs one checkpoint seed with a tied head ({tied}): the pair agrees through it")
    names = list(SEEDS) if args.model == "all" else [args.model]
    for name in names:
        t0 = time.perf_counter()
        if name in GGUF_SEEDS:  # one file, named `out`
            written = write_gguf_seed(name, args.out, args.tiny)
            size = written.stat().st_size
        else:
            written = args.out / name if args.model == "all" else args.out
            write_seed(name, written, args.tiny, args.shard_gb, args.branch_scale)
            size = sum(p.stat().st_size for p in written.glob("*.safetensors"))
        print(f"{written}  {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
