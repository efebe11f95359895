"""`linnet serve` beside llama.cpp's `llama-server` on the issue's workloads, one table of ratios.

Runs `linnet bench --serving` (the CLI, as a user would) once per dtype and workload, each server
started afresh, and prints per row: output tok/s (Linnet / llama-server), TTFT p99, ITL p99 and the
server's peak RSS of both, and whether Linnet meets all four (RSS within llama-server's + 10%); on
the shared-prefix workloads also Linnet's own TTFT without prefix caching. JSON documents go to --out.

    python bench/serving_vs_llama_server.py /tmp/qwen3-191m --out bench/results/serving_llama_xeon
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Linnet's own CPU kernels serve every dtype on `torch` (float32 too, since issue 38; ONNX Runtime before)
BACKEND = "torch"
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # linnet's short names; the long ones are taken too
LONG = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
MEMORY_MARGIN = 1.10
WORKLOADS = {
    "c8": ["--requests", "64", "--prompt-range", "32-128", "--new-tokens", "32", "--concurrency", "8"],
    "c32": ["--requests", "128", "--prompt-range", "32-128", "--new-tokens", "32", "--concurrency", "32"],
    "shared_prefix": ["--requests", "32", "--shared-prefix", "1000", "--prompt-range", "16-48", "--new-tokens", "32",
                      "--concurrency", "8"],
    "chats": ["--requests", "32", "--turns", "4", "--prompt-range", "32-96", "--new-tokens", "32",
              "--concurrency", "8"],
}
PREFIX_WORKLOADS = ("shared_prefix", "chats")


def run(model: str, dtype: str, workload: str, rows: int, out: Path) -> dict:
    targets = "http,http-no-prefix-cache,llama-server" if workload in PREFIX_WORKLOADS else "http,llama-server"
    path = out / f"serving_llama_191m_{dtype}_{workload}.json"
    cmd = ["linnet", "bench", model, "--serving", "--backend", BACKEND, "--dtype", dtype, "--rows", str(rows),
           *WORKLOADS[workload], "--target", targets, "--save", str(path), "--quiet"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return {t["target"]: t for t in json.loads(path.read_text())["targets"]}


def line(dtype: str, workload: str, rows: dict) -> str:
    own, ls = rows["http"], rows["llama-server"]
    ratio = own["output_tok_s"] / ls["output_tok_s"]
    own_rss, ls_rss = own.get("peak_memory_bytes"), ls.get("peak_memory_bytes")  # None where unmeasured
    memory = own_rss / ls_rss if own_rss and ls_rss else float("inf")
    met = (ratio >= 1.0 and own["ttft_ms_p99"] <= ls["ttft_ms_p99"] and own["itl_ms_p99"] <= ls["itl_ms_p99"]
           and memory <= MEMORY_MARGIN)
    cells = [dtype, workload, f"{own['output_tok_s']:.1f} / {ls['output_tok_s']:.1f} ({ratio:.2f}×)",
             f"{own['ttft_ms_p99']:,.0f} / {ls['ttft_ms_p99']:,.0f} ms",
             f"{own['itl_ms_p99']:.1f} / {ls['itl_ms_p99']:.1f} ms",
             f"{(own_rss or 0) / 2**20:,.0f} / {(ls_rss or 0) / 2**20:,.0f} MiB ({memory:.2f}×)"]
    off = rows.get("http-no-prefix-cache")
    cells.append(f"{off['ttft_ms_p99'] / own['ttft_ms_p99']:.1f}×" if off else "–")
    cells.append("met" if met else "short")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: " + ", ".join(DTYPES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()
    dtypes = [LONG.get(d, d) for d in a.dtypes.split(",")]
    workloads = a.workloads.split(",")
    if bad := [d for d in dtypes if d not in DTYPES] + [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"unknown dtype or workload: {', '.join(bad)} (dtypes: {', '.join(DTYPES)}; workloads: {', '.join(WORKLOADS)})")
    a.out.mkdir(parents=True, exist_ok=True)
    lines = ["| dtype | workload | output tok/s (Linnet / llama-server) | TTFT p99 | ITL p99 | server peak RSS | "
             "own TTFT p99 gain from prefix caching | all four |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for dtype in dtypes:
        for workload in workloads:
            lines.append(line(dtype, workload, run(a.model, dtype, workload, a.rows, a.out)))
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
