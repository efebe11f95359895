"""Two commits of Linnet side by side on one model: `linnet bench` of each, runs alternating.

A refactor must not make any backend slower. This checks out BASE into a git worktree, then
runs `linnet bench` over the same model with the base's code and with this checkout's code in
turn (A B A B ..., so a drifting shared machine favours neither), each in its own artifact cache
so every artifact is the commit's own, and prints per backend the median over rounds of each
round's decode speed and time to first token, and the ratio this / base.

    python bench/compare_checkouts.py HEAD~3 /tmp/qwen3-191m --rounds 3 --save bench/results/compare.json

Both checkouts run in this Python environment (the base's code put first on PYTHONPATH), so
they share every dependency's version.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(code: Path, model: str, cache: Path, args: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "LINNET_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "linnet_cli", "bench", model, "--backend", args.backends, "--compare", "none",
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--runs", str(args.runs),
           "--warmups", str(args.warmups), "--save", str(out), "--quiet"]
    subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the commit to compare against (e.g. HEAD~3)")
    p.add_argument("model", help="checkpoint folder (e.g. from bench/make_qwen3_191m.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", default="torch,inductor,onnxruntime,jax,stablehlo")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--save", type=Path, help="write every round's figures and the medians as JSON")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="linnet-compare-"))
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                   stdout=subprocess.DEVNULL)
    sides = {"base": base_tree, "this": ROOT}
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                result = bench(sides[name], args.model, work / f"cache-{name}", args, work / f"{name}-{r}.json")
                rounds[name].append({s["label"]: {"decode_tok_s": s["decode_tok_s"], "ttft_ms": s["ttft_ms"]}
                                     for s in result["sides"] if s["status"] == "ok"})
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v['decode_tok_s']:.1f} tok/s"
                                                            for k, v in rounds[name][-1].items()), file=sys.stderr)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)

    def median(name: str, label: str, key: str) -> float:
        return statistics.median(r[label][key] for r in rounds[name] if label in r)

    labels = [lab for lab in rounds["this"][0] if all(lab in r for r in rounds["base"] + rounds["this"])]
    summary = {}
    print("\n| backend | decode base | decode this | this/base | TTFT base | TTFT this | base/this |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for lab in labels:
        d0, d1 = median("base", lab, "decode_tok_s"), median("this", lab, "decode_tok_s")
        t0, t1 = median("base", lab, "ttft_ms"), median("this", lab, "ttft_ms")
        summary[lab] = {"decode_base": d0, "decode_this": d1, "ttft_base": t0, "ttft_this": t1}
        print(f"| {lab} | {d0:.1f} tok/s | {d1:.1f} tok/s | {d1 / d0:.3f}× | {t0:.1f} ms | {t1:.1f} ms | {t0 / t1:.3f}× |")
    if args.save:
        args.save.write_text(json.dumps({"base": args.base, "model": args.model, "rounds": rounds,
                                         "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
