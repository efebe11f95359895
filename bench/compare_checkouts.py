"""Two commits of Linnet side by side on one model: `linnet bench` of each, runs alternating.

A refactor must not make any backend slower. This checks out BASE into a git worktree, then
runs `linnet bench` over the same model with the base's code and with this checkout's code in
turn (A B A B ..., so a drifting shared machine favours neither), each in its own artifact cache
so every artifact is the commit's own, and prints per backend the median over rounds of each
round's decode speed and time to first token, and the ratio this / base. With `--serving`, the
serving bench instead (`linnet bench --serving`, which every commit takes): per target, output
tokens/s, TTFT p99 and ITL p99.

    python bench/compare_checkouts.py HEAD~3 /tmp/qwen3-191m --rounds 3 --save bench/results/compare.json
    python bench/compare_checkouts.py HEAD~3 /tmp/qwen3-191m --dtype q4_0 --backends torch --rounds 3
    python bench/compare_checkouts.py HEAD~1 /tmp/qwen3-191m --serving --backends torch --rounds 3
    python bench/compare_checkouts.py HEAD~3 /tmp/qwen3-191m --dtype q4_0 --backends torch --steps 400

`--steps N` holds one decode session of each commit open in its own process and steps them in
turn, one decode step each (N each), so both see the same minutes of a shared machine: on this
one, whose memory bandwidth drifts by half from minute to minute, it finds a 5% change that
whole `linnet bench` rounds cannot. `--steps N --prefill` steps prefills of `--prompt-tokens`
instead (time to first token without the sampling), the same way.

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


def step_child(model: str, backend: str, dtype: str, prompt_tokens: int, prefill: bool) -> None:
    """--steps' child: one session of this process's Linnet; a decode step (or with --prefill, a prompt's
    prefill) per line read, its seconds written."""
    import time

    from linnet_core.compile import load_model

    session, _ = load_model(model, backend, dtype or "auto", cache_len=1024)
    prompt = [5 + i % 1000 for i in range(prompt_tokens)]
    token, k = session.prefill(prompt).tokens[0], 0
    print("ready", flush=True)
    for _ in sys.stdin:
        if prefill:
            start = time.perf_counter()
            session.prefill(prompt)
            print(time.perf_counter() - start, flush=True)
            continue
        k = 0 if prompt_tokens + k >= 1000 else k  # back to the prompt's end before the cache fills
        start = time.perf_counter()
        token = session.decode([token], [prompt_tokens + k], [0]).tokens[0]
        k += 1
        print(time.perf_counter() - start, flush=True)


def interleaved_steps(sides: dict[str, Path], work: Path, backend: str, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of a decode step for each side, the sides stepping in turn (--steps)."""
    # a waiting side's OpenMP threads would spin on the cores the stepping side needs
    procs = {}
    for name, code in sides.items():
        env = {**os.environ, "PYTHONPATH": str(code), "LINNET_CACHE": str(work / f"cache-{name}"),
               "OMP_WAIT_POLICY": "PASSIVE"}
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--child", args.model, backend, args.dtype or "", str(args.prompt_tokens),
             "prefill" if args.prefill else "decode"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if procs[name].stdout.readline().strip() != "ready":
            raise SystemExit(f"{name}: the {backend} session did not start")
    times: dict[str, list[float]] = {name: [] for name in procs}
    for i in range(args.steps):
        for name in (list(procs) if i % 2 else list(procs)[::-1]):
            procs[name].stdin.write("\n")
            procs[name].stdin.flush()
            times[name].append(float(procs[name].stdout.readline()))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    warm = min(20, args.steps // 5)
    return {name: statistics.median(t[warm:]) for name, t in times.items()}


def bench(code: Path, model: str, cache: Path, args: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "LINNET_CACHE": str(cache)}
    if args.serving:
        cmd = [sys.executable, "-m", "linnet_cli", "bench", model, "--serving", "--backend", args.backends,
               "--target", args.targets, "--rows", str(args.rows), "--requests", str(args.requests),
               "--prompt-range", args.prompt_range, "--new-tokens", str(args.new_tokens),
               "--concurrency", str(args.rows), "--save", str(out), "--quiet"]
    else:
        cmd = [sys.executable, "-m", "linnet_cli", "bench", model, "--backend", args.backends, "--compare", "none",
               *(["--dtype", args.dtype] if args.dtype else []), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--warmups", str(args.warmups),
               "--save", str(out), "--quiet"]
    subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# (what a round records, its JSON key, the column's name, whether higher is better)
DECODE = (("decode_tok_s", "decode", True), ("ttft_ms", "TTFT", False))
SERVING = (("output_tok_s", "output tok/s", True), ("ttft_ms_p99", "TTFT p99", False),
           ("itl_ms_p99", "ITL p99", False))


def figures(result: dict, serving: bool) -> dict[str, dict[str, float]]:
    if serving:
        return {t["label"]: {key: t[key] for key, _, _ in SERVING} for t in result["targets"] if not t["failed"]}
    return {s["label"]: {key: s[key] for key, _, _ in DECODE} for s in result["sides"] if s["status"] == "ok"}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        model, backend, dtype, prompt_tokens, mode = sys.argv[2:7]
        return step_child(model, backend, dtype, int(prompt_tokens), mode == "prefill")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the commit to compare against (e.g. HEAD~3)")
    p.add_argument("model", help="checkpoint folder (e.g. from bench/make_qwen3_191m.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", help="the weights' dtype for both (float32, bf16, q8_0, ...; default: bench's)")
    p.add_argument("--backends", default="torch,inductor,onnxruntime,jax,stablehlo")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--save", type=Path, help="write every round's figures and the medians as JSON")
    p.add_argument("--steps", type=int, help="decode steps of each side in turn, in two open sessions (see above)")
    p.add_argument("--prefill", action="store_true", help="--steps: time prefills of --prompt-tokens, not decode steps")
    p.add_argument("--serving", action="store_true", help="compare the serving bench instead of decode")
    p.add_argument("--targets", default="engine,http", help="--serving: the serving bench's targets")
    p.add_argument("--rows", type=int, default=8, help="--serving: engine rows (and requests in flight)")
    p.add_argument("--requests", type=int, default=64, help="--serving: requests per round")
    p.add_argument("--prompt-range", default="32-128", help="--serving: prompt lengths, MIN-MAX")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="linnet-compare-"))
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                   stdout=subprocess.DEVNULL)
    sides = {"base": base_tree, "this": ROOT}
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    if args.steps:
        try:
            steps = {backend: interleaved_steps(sides, work, backend, args) for backend in args.backends.split(",")}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
        what = "a prefill" if args.prefill else "a step"
        print(f"\n| backend | base ms {what} | this ms {what} | this/base speed |\n|---|---:|---:|---:|")
        for backend, m in steps.items():
            print(f"| {backend} | {m['base'] * 1e3:.3f} | {m['this'] * 1e3:.3f} | {m['base'] / m['this']:.3f}× |")
        if args.save:
            args.save.write_text(json.dumps({"base": args.base, "model": args.model, "dtype": args.dtype,
                                             "steps": args.steps, "prefill": args.prefill,
                                             "prompt_tokens": args.prompt_tokens, "median_step_s": steps}, indent=1))
        return
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                result = bench(sides[name], args.model, work / f"cache-{name}", args, work / f"{name}-{r}.json")
                rounds[name].append(figures(result, args.serving))
                first = (SERVING if args.serving else DECODE)[0][0]
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[first]:.1f}"
                                                            for k, v in rounds[name][-1].items()), file=sys.stderr)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)

    def median(name: str, label: str, key: str) -> float:
        return statistics.median(r[label][key] for r in rounds[name] if label in r)

    labels = [lab for lab in rounds["this"][0] if all(lab in r for r in rounds["base"] + rounds["this"])]
    columns = SERVING if args.serving else DECODE
    summary = {}
    print("\n| " + ("target" if args.serving else "backend") + " | " + " | ".join(
        f"{name} base | {name} this | {'this/base' if higher else 'base/this'}" for _, name, higher in columns) + " |")
    print("|---|" + "---:|---:|---:|" * len(columns))
    for lab in labels:
        cells, summary[lab] = [], {}
        for key, _, higher in columns:
            b0, b1 = median("base", lab, key), median("this", lab, key)
            summary[lab].update({f"{key}_base": b0, f"{key}_this": b1})
            cells += [f"{b0:,.1f}", f"{b1:,.1f}", f"{(b1 / b0 if higher else b0 / b1):.3f}×"]
        print(f"| {lab} | " + " | ".join(cells) + " |")
    if args.save:
        args.save.write_text(json.dumps({"base": args.base, "model": args.model, "rounds": rounds,
                                         "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
