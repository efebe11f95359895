"""`linnet serve --ray` beside one `linnet serve`, same rows in total, on the serving bench's workloads.

Starts, through the CLI as a user would: one `linnet serve` (all the machine's threads, ROWS rows);
`linnet serve --ray` with 2 replicas of 1 CPU and ROWS/2 rows each, routed by prompt prefix; and the
same with `--no-affinity` (Ray Serve's own router: the shorter of two queues). Then runs
`linnet bench --serving --url` against each on the workloads of `serving_vs_llama_server.py` (random
prompts at 8 in flight, a 1,000-token shared system prompt, 4-turn chats), in turns, and prints per
workload throughput, TTFT p99 and ITL p99 of each; what the front adds to a request (median and p99:
its hop to a replica from its /metrics, one request at a time first, then over every request of the
workloads; and /tokenize, which runs no engine step, end to end against one `linnet serve`'s); the
share of each workload's prompt tokens the prefix caches reused; and how many requests the prefix's
owner took.

    python bench/serving_ray.py /tmp/qwen3-191m --dtype bf16 --out bench/results/serving_ray
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serving_vs_llama_server import WORKLOADS

from linnet_core.serve import free_port
from linnet_core.serve.metrics import sample_sum

SERVERS = ("single", "ray", "ray-no-affinity")
LABELS = {"single": "linnet serve (2 threads)", "ray": "Ray, prefix-aware (2 x 1 CPU)",
          "ray-no-affinity": "Ray, queue-length routing (2 x 1 CPU)"}


def start(name: str, model: str, dtype: str, rows: int, port: int, log: Path) -> subprocess.Popen:
    cmd = ["linnet", "serve", model, "--dtype", dtype, "--port", str(port), "--quiet"]
    if name == "single":
        cmd += ["--rows", str(rows)]
    else:
        cmd += ["--ray", "--replicas", "2", "--replica-cpus", "1", "--rows", str(rows // 2)]
        cmd += ["--no-affinity"] if name == "ray-no-affinity" else []
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base: str, replicas: int | None, timeout: float = 600) -> None:
    """Until /health answers (and, on Ray, every replica reports)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                if replicas is None or sample_sum(httpx.get(f"{base}/metrics").text, "linnet_ray_replicas") >= replicas:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{base} did not come up in {timeout:.0f} s")


def idle_latency(base: str, ray: bool, requests: int = 300) -> dict[str, float]:
    """One request at a time on an idle server: /tokenize end to end (no engine step: on Ray, what
    is left is the front and its hop), then one-token completions; on Ray, the front's own measure
    of its hop over both (its /metrics)."""
    out = {}
    with httpx.Client(timeout=60) as client:
        for name, ask in (("tokenize", lambda i: client.post(f"{base}/tokenize", json={"prompt": f"{i} idle probe"})),
                          ("completion", lambda i: client.post(f"{base}/v1/completions",
                                                               json={"prompt": f"{i} idle probe", "max_tokens": 1}))):
            seconds = []
            for i in range(requests):
                began = time.perf_counter()
                ask(i).raise_for_status()
                seconds.append(time.perf_counter() - began)
            seconds.sort()
            out[f"{name}_p50"], out[f"{name}_p99"] = seconds[len(seconds) // 2], seconds[int(0.99 * len(seconds))]
        if ray:
            text = client.get(f"{base}/metrics").text
            out["hop_p50"] = sample_sum(text, "linnet_ray_forward_overhead_seconds", quantile="0.5")
            out["hop_p99"] = sample_sum(text, "linnet_ray_forward_overhead_seconds", quantile="0.99")
    return out


def reused(base: str) -> tuple[float, float]:
    """Prompt tokens the prefix caches reused, and prompt tokens in all, over every replica so far."""
    text = httpx.get(f"{base}/metrics").text
    return (sample_sum(text, "linnet_prefix_cache_reused_tokens_total"), sample_sum(text, "linnet_prompt_tokens_total"))


def bench(model: str, base: str, workload: str, path: Path) -> dict:
    cmd = ["linnet", "bench", model, "--serving", "--target", "none", "--url", f"{base}/v1", *WORKLOADS[workload],
           "--save", str(path), "--quiet"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(path.read_text())["targets"][0]


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 2)  # Ctrl-C: `linnet serve --ray` deletes its application and stops its cluster
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rows", type=int, default=8, help="rows in total: the single server's, split over 2 replicas")
    ap.add_argument("--workloads", default="c8,shared_prefix,chats")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving_ray"))
    a = ap.parse_args()
    workloads = a.workloads.split(",")
    if bad := [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"unknown workload: {', '.join(bad)} (workloads: {', '.join(WORKLOADS)})")
    a.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str], dict] = {}
    overhead: dict[str, tuple[float, float, float, float]] = {}
    idle: dict[str, dict[str, float]] = {}
    for name in SERVERS:  # one at a time: each has the machine to itself
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start(name, a.model, a.dtype, a.rows, port, a.out / f"{name}.log")
        try:
            wait_ready(base, None if name == "single" else 2)
            idle[name] = idle_latency(base, ray=name != "single")
            for workload in workloads:
                before = reused(base)
                rows[name, workload] = bench(a.model, base, workload, a.out / f"{name}_{workload}.json")
                after = reused(base)
                rows[name, workload]["prompt_reused"] = (after[0] - before[0]) / max(1.0, after[1] - before[1])
            if name != "single":
                text = httpx.get(f"{base}/metrics").text
                overhead[name] = (sample_sum(text, "linnet_ray_forward_overhead_seconds", quantile="0.5"),
                                  sample_sum(text, "linnet_ray_forward_overhead_seconds", quantile="0.99"),
                                  sample_sum(text, "linnet_ray_routed_total", placement="owner"),
                                  sample_sum(text, "linnet_ray_routed_total", placement="spilled"))
                (a.out / f"{name}_metrics.txt").write_text(text)
        finally:
            stop(proc)
    print(f"| workload | {' | '.join(LABELS[n] + ': tok/s, TTFT p99, ITL p99, prompt reused' for n in SERVERS)} |")
    print("|---|" + "---:|" * len(SERVERS))
    for workload in workloads:
        one = rows["single", workload]["output_tok_s"]
        cells = []
        for name in SERVERS:
            r = rows[name, workload]
            cells.append(f"{r['output_tok_s']:.1f} ({r['output_tok_s'] / one:.2f}x), {r['ttft_ms_p99']:,.0f} ms, "
                         f"{r['itl_ms_p99']:.1f} ms, {r['prompt_reused']:.0%}")
        print(f"| {workload} | {' | '.join(cells)} |")
    (a.out / "idle_latency.json").write_text(json.dumps(idle, indent=1))
    (a.out / "prompt_reused.json").write_text(json.dumps({f"{n} {w}": r["prompt_reused"] for (n, w), r in rows.items()},
                                                         indent=1))
    one = idle["single"]
    for name, (p50, p99, owner, spilled) in overhead.items():
        i = idle[name]
        print(f"{LABELS[name]}: the front's hop {i['hop_p50'] * 1000:.2f} ms median, {i['hop_p99'] * 1000:.2f} ms p99 "
              f"one request at a time, {p50 * 1000:.2f} / {p99 * 1000:.2f} ms over all requests; /tokenize end to end "
              f"{i['tokenize_p50'] * 1000:.2f} / {i['tokenize_p99'] * 1000:.2f} ms against one linnet serve's "
              f"{one['tokenize_p50'] * 1000:.2f} / {one['tokenize_p99'] * 1000:.2f} ms; a one-token completion "
              f"{i['completion_p50'] * 1000:.1f} / {i['completion_p99'] * 1000:.1f} ms against "
              f"{one['completion_p50'] * 1000:.1f} / {one['completion_p99'] * 1000:.1f} ms; prefix owner took "
              f"{owner:.0f}, spilled {spilled:.0f}")


if __name__ == "__main__":
    main()
