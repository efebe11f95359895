"""How fast Linnet's 16-bit and float32 kernels stream weights, beside a plain read of the same memory
and PyTorch's own kernels (oneDNN's packed weights for float32), at the 191M Qwen3's decode-step shapes (8 layers and the output head) or
Qwen3-4B's (4 layers).

    python bench/half_gemv.py                 # medians of 20, 2 threads, a table
    python bench/half_gemv.py --shapes 4b --json out.json

Decode at batch 1 reads every weight once per token, so a kernel's bytes per second over weights
larger than the L3 (322 MB here) bounds tokens per second. The weights lie in 2 MiB pages, as a
session maps them. The prompt rows time a 128-token product with every layer's matrices.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from linnet_core.backends.cpu import extension
from timing import median_seconds  # bench/timing.py, beside this script

LAYERS = {  # qkv, o, gate+up, down: [N, K]
    "191m": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
}
SHAPES = {"191m": LAYERS["191m"] * 8 + [(32000, 1024)], "4b": LAYERS["4b"] * 4}


def weights(shapes: list, dtype: torch.dtype, g: torch.Generator, ext) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every matrix of `shapes`, random, in one buffer of 2 MiB pages (as a session maps the artifact's)."""
    flat = ext.huge_page_zeros([sum(n * k for n, k in shapes)], dtype)
    out, at = [], 0
    for n, k in shapes:
        w = flat[at:at + n * k].view(n, k)
        w.copy_(torch.randn(n, k, generator=g))
        out.append(w)
        at += n * k
    return flat, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="191m")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = extension.extension()
    if ext is None:
        raise SystemExit(f"Linnet's CPU kernels do not run here: {extension.why_not()}")
    g = torch.Generator().manual_seed(0)
    rows: dict[str, float] = {}
    shapes, layer = SHAPES[args.shapes], LAYERS[args.shapes]
    print(f"kernel level: {extension.level()}")
    for dtype, name, gemv in ((torch.bfloat16, "bf16", ext.gemv_bf16), (torch.float16, "f16", ext.gemv_f16),
                              (torch.float32, "f32", ext.gemv_f32)):
        flat, ws = weights(shapes, dtype, g, ext)
        nbytes = flat.numel() * flat.element_size()
        if not rows:  # the same bytes read as float32
            rows["plain read (torch.sum)"] = nbytes / median_seconds(flat.view(torch.float32).sum, args.runs) / 1e9
        kernels = [(f"Linnet's {name} GEMV", gemv), (f"F.linear {name}", F.linear)]
        if dtype != torch.bfloat16 or ext.packed_bf16_dot():  # the layout sessions hold these in (PackedFloatLinear)
            packed = {id(w): ext.repack_rows8_float(w) for w in ws}
            kernels.insert(0, (f"Linnet's packed {name} GEMV", lambda x, w: ext.packed_float_linear(x, packed[id(w)], w.shape[0])))
        if dtype == torch.float32:  # what float32 sessions ran before: oneDNN's weights reordered at load
            onednn = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws}
            kernels.append(("oneDNN packed f32", lambda x, w: torch.ops.mkldnn._linear_pointwise(x, onednn[id(w)], None, "none", [], "")))
        for m in (1, 2):
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in shapes}}
            for label, fn in kernels:
                t = median_seconds(lambda: [fn(xs[w.shape[1]], w) for w in ws], args.runs)
                rows[f"{label}, {m} token row(s)"] = nbytes / t / 1e9
        # prompts: Linnet's tiles against oneDNN's (float32; bf16 on AMX where present) or MKL over widened copies
        contenders = {
            torch.float32: [("oneDNN packed f32 GEMM", lambda x, w: torch.ops.mkldnn._linear_pointwise(
                x, onednn[id(w)], None, "none", [], ""))],
            torch.bfloat16: [("F.linear bf16 (oneDNN)", F.linear)] if ext.packed_bf16_dot() else None,
            torch.float16: [("Linnet's f16 GEMM", ext.gemm_f16),
                            ("float32 F.linear over widened copies", lambda x, w: F.linear(x.float(), w.float()))],
        }[dtype]
        if contenders is None:
            continue
        layers = ws[:len(layer) * (len(shapes) // len(layer))]
        xs = {k: torch.randn(128, k, generator=g).to(dtype) for k in {k for _, k in layer}}
        flops = sum(2 * 128 * w.numel() for w in layers)
        runs = max(3, args.runs // 4)
        packed_gemm = (f"Linnet's packed {name} GEMM", lambda x, w: ext.packed_float_linear(x, packed[id(w)], w.shape[0]))
        for label, fn in [packed_gemm, *contenders]:
            t = median_seconds(lambda: [fn(xs[w.shape[1]], w) for w in layers], runs)
            rows[f"{label}, 128-token prompt (GFLOP/s)"] = flops / t / 1e9
    print(f"{'':60s} GB/s or GFLOP/s")
    for name, value in rows.items():
        print(f"{name:60s} {value:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "runs": args.runs, "shapes": shapes, "figures": rows}, f, indent=1)


if __name__ == "__main__":
    main()
