"""Warm load time, side by side: Linnet's sessions against transformers on the same checkpoint.

    python bench/load_time.py /tmp/qwen3-4b --side torch:bfloat16 --side transformers:bfloat16 \
        --side onnxruntime:float32 --side transformers:float32 --runs 5

Each run of each side is a fresh Python process (the sides take turns, so the machine's state is
shared fairly), timed in phases from the process's start: importing the framework, opening the
model (Linnet: the cached artifact, mapped; transformers: `from_pretrained`), and the first token
(a two-token prefill, which reads every weight once). Warm: the artifact is compiled and the
files are in the page cache before the first timed run (one untimed run of each side first).
`--grouped` runs each side's runs back to back after its own untimed run, for sides whose files
do not fit in the page cache together (Qwen3-4B in float32: 16 GB of ONNX data beside
transformers' 16 GB of float32 tensors on a 24 GiB machine); otherwise every run would be cold.
Prints each phase's median and each Linnet side's total against transformers' at its dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
side, model, dtype, cache_len = sys.argv[1:5]
import torch
if side == "transformers":
    from transformers import AutoModelForCausalLM
    t1 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    t2 = time.perf_counter()
    with torch.inference_mode():
        m(torch.tensor([[1, 2]]))
else:
    from linnet_core.compile import load_model
    t1 = time.perf_counter()
    session, compiled = load_model(model, side, dtype, int(cache_len), rows=1, device="cpu")
    assert compiled.hit, "the artifact was not cached: compile it first"
    t2 = time.perf_counter()
    session.prefill([1, 2])
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "first_token": t3 - t2, "total": t3 - t0}))
'''

PHASES = ("import", "open", "first_token", "total")


def run_side(side: str, dtype: str, model: Path, cache_len: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, side, str(model), dtype, str(cache_len)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{side} {dtype}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--side", action="append", required=True, help="BACKEND:DTYPE, or transformers:DTYPE")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cache-len", type=int, default=160)
    ap.add_argument("--grouped", action="store_true",
                    help="each side's runs back to back, after its own untimed run (sides that do not fit together)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    sides = [tuple(s.split(":", 1)) for s in args.side]
    samples: dict[tuple[str, str], list[dict]] = {s: [] for s in sides}
    if args.grouped:
        for s in sides:
            run_side(*s, args.model, args.cache_len)  # warm: this side's files in the page cache
            samples[s] = [run_side(*s, args.model, args.cache_len) for _ in range(args.runs)]
    else:
        for s in sides:  # warm: compiled artifacts checked, files in the page cache
            run_side(*s, args.model, args.cache_len)
        for r in range(args.runs):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                samples[s].append(run_side(*s, args.model, args.cache_len))
    med = {s: {p: statistics.median(x[p] for x in samples[s]) for p in PHASES} for s in sides}
    print(f"{args.model.name}: warm load, median of {args.runs}, seconds\n")
    print("| side | import | open | first token | total | vs transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    for (side, dtype), m in med.items():
        ref = med.get(("transformers", dtype))
        ratio = f"{m['total'] / ref['total']:.2f}×" if ref and side != "transformers" else "–"
        print(f"| {side} {dtype} | {m['import']:.2f} | {m['open']:.2f} | {m['first_token']:.2f} | "
              f"{m['total']:.2f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "runs": args.runs, "grouped": args.grouped,
                                         "date": time.strftime("%F"),
                                         "median": {f"{a}:{b}": m for (a, b), m in med.items()},
                                         "samples": {f"{a}:{b}": x for (a, b), x in samples.items()}}, indent=2))


if __name__ == "__main__":
    main()
