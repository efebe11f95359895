"""The reference pages' models at their real size on this machine: every command a user would run,
each in its own process, with its wall time and peak memory.

    python bench/real_size.py                                  # all three, every step (~1 h on 2 cores)
    python bench/real_size.py --models qwen3-4b --steps compile,run,verify
    python bench/real_size.py --markdown                       # the README's table

For each model (random weights with the real config, bench/make_seed_models.py, bfloat16):
`compile` and `run` on the torch backend, `verify`, `export hf`, `export gguf` (bf16, checked in
llama.cpp), and `bench --sequential` (128 prompt tokens, 32 new) of every CPU backend against
transformers and llama.cpp. The peak is the child's own high-water RSS (wait4's ru_maxrss; the
parent here stays small, so what Linux carries over at fork does not matter). Exports, the cache
and, unless --keep, the checkpoint are removed after each model: the three together would not
fit on this machine's disk. Results go to --out as JSON, and as a Markdown table with --markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("qwen3-4b", "phi-3-mini-4k-instruct", "mistral-7b-instruct-v0.3")
STEPS = ("compile", "run", "verify", "export-hf", "export-gguf", "bench")
LIMIT_GIB = 24


def commands(model: Path, work: Path) -> dict[str, list[str]]:
    common = ["--dtype", "bf16"]
    return {
        "compile": ["compile", str(model), "--backend", "torch", *common, "--cache-len", "512"],
        "run": ["run", str(model), "--backend", "torch", *common, "--cache-len", "512", "--prompt",
                "The list object is", "--max-new-tokens", "16"],
        "verify": ["verify", str(model), "--backend", "torch", *common, "--cache-len", "512", "--steps", "4"],
        "export-hf": ["export", "hf", str(model), str(work / "hf"), "--dtype", "bf16"],
        "export-gguf": ["export", "gguf", str(model), str(work / "model.gguf"), "--dtype", "bf16"],
        "bench": ["bench", str(model), *common, "--sequential", "--prompt-tokens", "128", "--new-tokens", "32",
                  "--runs", "3", "--warmups", "1", "--compare", "llama.cpp", "--save", str(work / "bench.json"),
                  "--markdown"],
    }


def measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Run `cmd`; its exit code, wall time, peak RSS and last line of output."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return {"rc": os.waitstatus_to_exitcode(status), "seconds": round(time.perf_counter() - t0, 1),
            "peak_gib": round(usage.ru_maxrss * 1024 / 2**30, 2), "last": lines[-1][:300] if lines else ""}


def run_model(name: str, steps: list[str], root: Path, keep: bool, tiny: bool = False) -> dict:
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    model = root / "seeds" / name
    env = {**os.environ, "LINNET_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1"}
    linnet = [sys.executable, "-m", "linnet_cli"]
    out: dict = {"model": name, "steps": {}}
    if not (model / "config.json").is_file():
        seed = [sys.executable, str(ROOT / "bench" / "make_seed_models.py"), name, str(model)]
        out["seed"] = measured(seed + ["--tiny"] * tiny, env, work / "seed.log")
        print(f"{name} seed: {out['seed']}", flush=True)
    out["weights_gb"] = round(sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9, 2)
    cmds = commands(model, work)
    for step in steps:
        r = measured(linnet + cmds[step], env, work / f"{step}.log")
        out["steps"][step] = r
        print(f"{name} {step}: {r}", flush=True)
        if step == "bench" and (work / "bench.json").is_file():
            out["bench"] = json.loads((work / "bench.json").read_text())
        for export in ("hf", "model.gguf"):
            shutil.rmtree(work / export, ignore_errors=True) if (work / export).is_dir() else \
                (work / export).unlink(missing_ok=True)
    shutil.rmtree(root / "cache", ignore_errors=True)
    if not keep:
        shutil.rmtree(model, ignore_errors=True)
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| model | weights | " + " | ".join(STEPS) + " |", "|---|---:|" + "---|" * len(STEPS)]
    for r in results:
        cells = []
        for step in STEPS:
            s = r["steps"].get(step)
            cells.append("–" if s is None else
                         f"{'ok' if s['rc'] == 0 else 'exit ' + str(s['rc'])}, {s['seconds']:.0f} s, {s['peak_gib']} GiB")
        lines.append(f"| {r['model']} | {r['weights_gb']} GB | " + " | ".join(cells) + " |")
    for r in results:
        b = r.get("bench")
        if not b:
            continue
        lines += ["", f"**{r['model']}**, bench --sequential (bf16, 128 prompt tokens, 32 new, median of 3):", "",
                  "| side | decode | roofline | TTFT | load | peak memory | note |", "|---|---:|---:|---:|---:|---:|---|"]
        for s in b["sides"]:
            def f(v, fmt):
                return "–" if v is None else fmt.format(v)
            lines.append(f"| {s['label']} | {f(s['decode_tok_s'], '{:.2f} tok/s')} | {f(s['roofline'], '{:.0%}')} | "
                         f"{f(s['ttft_ms'], '{:.0f} ms')} | {f(s['load_s'], '{:.1f} s')} | "
                         f"{f(s['peak_memory_bytes'] and s['peak_memory_bytes'] / 2**30, '{:.1f} GiB')} | "
                         f"{(s['reason'] or '') if s['status'] != 'ok' else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--root", type=Path, default=Path("/tmp/linnet-real-size"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_size.json")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (about 30 GB for all three)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the same families at test size (checks this script)")
    args = ap.parse_args()
    steps = args.steps.split(",")
    unknown = set(steps) - set(STEPS) | set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown: {', '.join(sorted(unknown))}")
    results = [run_model(name, steps, args.root, args.keep, args.tiny) for name in args.models.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, indent=1))
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
