"""How fast Linnet's q8_0 / q4_0 kernel streams weights, beside a plain read of memory and a float32
F.linear over the dequantized weights, at the Qwen3-4B MLP's shape (2560 -> 9728).

    python bench/quant_gemv.py                 # medians of 30, 2 threads, a table
    python bench/quant_gemv.py --json out.json

Decode at batch 1 reads every weight once per token, so a kernel's bytes per second over weights
larger than the L3 is what bounds tokens per second. Eight matrices are cycled (112 MB in q4_0)
so none is served from the cache. The prompt row times one 128-token GEMM of one matrix.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from linnet_core.backends.cpu import extension
from linnet_core.quant import dequantize, quantize
from timing import median_seconds  # bench/timing.py, beside this script

N, K, MATRICES = 9728, 2560, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if extension.extension() is None:
        raise SystemExit(f"Linnet's CPU kernels do not run here: {extension.why_not()}")
    g = torch.Generator().manual_seed(0)
    stream = torch.ones(64 << 20)  # 256 MB of float32
    rows = {"plain read (torch.sum, float32)": stream.numel() * 4 / median_seconds(stream.sum, args.runs) / 1e9}
    for fmt in ("q8_0", "q4_0"):
        blocks = [quantize(torch.randn(N, K, generator=g), fmt) for _ in range(MATRICES)]
        packed = [extension.repack(b, fmt) for b in blocks]
        nbytes = sum(b.numel() for b in blocks)
        for m in (1, 2, 4):
            x = torch.randn(m, K, generator=g)
            t = median_seconds(lambda: [extension.quant_linear(x, p, fmt, N) for p in packed], args.runs)
            rows[f"{fmt} kernel, {m} token row(s)"] = nbytes / t / 1e9
        x = torch.randn(128, K, generator=g)
        rows[f"{fmt} kernel, 128-token prompt (ms)"] = 1e3 * median_seconds(
            lambda: extension.quant_linear(x, packed[0], fmt, N), max(5, args.runs // 6))
        dense = dequantize(blocks[0], fmt)
        rows[f"{fmt} as float32 F.linear, 128-token prompt (ms)"] = 1e3 * median_seconds(
            lambda: F.linear(x, dense), max(5, args.runs // 6))
    print(f"{'':48s} GB/s or ms")
    for name, value in rows.items():
        print(f"{name:48s} {value:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "runs": args.runs, "shape": [N, K], "figures": rows}, f, indent=1)


if __name__ == "__main__":
    main()
