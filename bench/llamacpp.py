"""llama.cpp as a comparator: the bench checkpoint written as GGUF, run through llama-cpp-python.

The GGUF here is for the benchmark's random Qwen3 only (float32, a placeholder SentencePiece
vocabulary of the right size, since llama.cpp needs one and the bench feeds token ids): Linnet's
IR already names its weights with llama.cpp's tensor roles, so the map is the graph's own names.
Qwen3 uses NeoX-style rope in llama.cpp, so no Q/K permutation is needed.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def available() -> str | None:
    """None when llama-cpp-python and gguf import, else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install llama-cpp-python gguf)"
    return None


def write_gguf(checkpoint: Path, out: Path) -> Path:
    import gguf

    from linnet_core.models import build_graph, load_spec
    from linnet_core.weights import Checkpoint

    if out.is_file():
        return out
    spec = load_spec(checkpoint)
    if spec.family != "qwen3":
        raise ValueError("the bench's GGUF writer covers the bench's Qwen3 only")
    graph = build_graph(spec)  # unfused: one param per checkpoint tensor, named by llama.cpp role
    ckpt = Checkpoint.from_folder(checkpoint)
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"tok{i}".encode() for i in range(3, spec.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for full, p, layer in graph.all_params():
        if full == "output.weight" and spec.tie_word_embeddings:
            continue
        w.add_tensor(full, ckpt.get(p.sources(layer)[0]).float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def load(path: Path, n_ctx: int, logits_all: bool = False):
    import torch
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), n_batch=512, verbose=False,
                 logits_all=logits_all)


def decode(llm, prompt: list[int], new: int) -> tuple[float, float]:
    """(time to first token s, decode tok/s), greedy, after a cleared KV cache."""
    t0 = time.perf_counter()
    gen = llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True)
    next(gen)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(new - 1):
        next(gen)
    return ttft, (new - 1) / (time.perf_counter() - t1)


def last_logits(path: Path, n_ctx: int, prompt: list[int]) -> np.ndarray:
    """Logits after the prompt, for the distance from the reference (a model kept logits_all)."""
    llm = load(path, n_ctx, logits_all=True)
    llm.eval(prompt)
    return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
