"""Linnet's decode step against llama.cpp's, interleaved in one process: one step each, in turn.

`linnet bench --sequential` runs each side in its own minutes, and on a shared machine those
minutes differ; here both engines take turns on the same weights, so the ratio is the engines'.

    python bench/step_ab_llamacpp.py /tmp/qwen3-4b model-bf16.gguf --dtype bf16 --steps 40

The GGUF must hold the same weights (`linnet export gguf MODEL F --dtype D --no-check`). With
`--prefill` the turns are prefills of the prompt instead (each engine's cache emptied first). Taking
turns is not free: on a Zen 3 the 191M float16 prefill ran 233 ms in blocks of its own, ~275 ms each
right after llama.cpp's (llama.cpp's 260 and ~250), so read both orders before a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder (or GGUF) Linnet compiles")
    ap.add_argument("gguf", help="llama.cpp's GGUF of the same weights")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefill", action="store_true", help="time prefills of --prompt-tokens, not decode steps")
    args = ap.parse_args()

    import torch

    from linnet_core.backends.artifact import WEIGHTS_FILE
    from linnet_core.compile import compile_model, load_model
    from linnet_core.gguf.llama_open import open_llama
    from linnet_core.weights import drop_cached

    positions = args.prompt_tokens + args.steps + 1
    # both files read afresh before they are mapped, as `linnet bench` does: the page cache keeps a
    # file in the pages it was first read into, and 4 KiB ones stream ~20% slower than 2 MiB ones
    compiled = compile_model(args.model, args.backend, args.dtype, cache_len=positions)
    for path in (compiled.artifact / WEIGHTS_FILE, Path(args.gguf)):
        drop_cached(path)
    session, compiled = load_model(args.model, args.backend, args.dtype, cache_len=positions)
    llm = open_llama(model_path=args.gguf, n_ctx=positions, n_batch=512, n_threads=torch.get_num_threads(),
                     verbose=False)
    prompt = [5 + i % 1000 for i in range(args.prompt_tokens)]
    token = session.prefill(prompt).tokens[0]
    llm.eval(prompt)
    linnet, llama = [], []
    for k in range(args.steps):
        if args.prefill:
            t = time.perf_counter()
            session.prefill(prompt)
            linnet.append(time.perf_counter() - t)
            llm.reset()  # back to position 0: eval removes the cache's later entries first
            t = time.perf_counter()
            llm.eval(prompt)
            llama.append(time.perf_counter() - t)
            continue
        t = time.perf_counter()
        token = session.decode([token], [len(prompt) + k], [0]).tokens[0]
        linnet.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.eval([7])
        llama.append(time.perf_counter() - t)
    a, b = statistics.median(linnet), statistics.median(llama)
    what = f"a {args.prompt_tokens}-token prefill" if args.prefill else "a step"
    print(f"{compiled.backend} {compiled.dtype}: Linnet {a * 1e3:.1f} ms {what}, llama.cpp {b * 1e3:.1f} ms "
          f"(median of {args.steps}, interleaved): {b / a:.3f}x llama.cpp's speed")


if __name__ == "__main__":
    main()
