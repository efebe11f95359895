"""How quickly a loaded `linnet serve` still answers: /tokenize (no engine step, only the server's
event loop) probed every 50 ms while `linnet bench --serving` keeps ROWS requests decoding.

The loop shares the process with the engine's thread: whatever that thread holds the GIL for, the
loop waits out (Linnet's kernels release it while they compute, as torch's operators do). Prints
the probe's median, p90 and p99 and the workload's throughput, TTFT and ITL.

    python bench/serving_loop_latency.py /tmp/qwen3-191m --dtype bf16 --threads 1 --rows 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serving_ray import wait_ready

from linnet_core.serve import free_port

PROBE_EVERY_S = 0.05


def probe(base: str, stop: threading.Event, seconds: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            began = time.perf_counter()
            client.post(f"{base}/tokenize", json={"prompt": "probe words"}).raise_for_status()
            seconds.append(time.perf_counter() - began)
            time.sleep(PROBE_EVERY_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--rows", type=int, default=4, help="the server's rows, and the requests kept in flight")
    ap.add_argument("--requests", type=int, default=48)
    a = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    server = subprocess.Popen(["linnet", "serve", a.model, "--dtype", a.dtype, "--rows", str(a.rows), "--port",
                               str(port), "--quiet"], env=env, start_new_session=True)
    try:
        wait_ready(base, None)
        stop, seconds = threading.Event(), []
        prober = threading.Thread(target=probe, args=(base, stop, seconds))
        prober.start()
        with tempfile.TemporaryDirectory() as tmp:
            saved = Path(tmp) / "load.json"
            subprocess.run(["linnet", "bench", a.model, "--serving", "--target", "none", "--url", f"{base}/v1",
                            "--requests", str(a.requests), "--prompt-range", "32-128", "--new-tokens", "32",
                            "--concurrency", str(a.rows), "--save", str(saved), "--quiet"], check=True)
            load = json.loads(saved.read_text())["targets"][0]
        stop.set()
        prober.join()
    finally:
        server.terminate()
        server.wait(timeout=60)
    seconds.sort()
    q = {p: seconds[min(len(seconds) - 1, int(p * len(seconds)))] * 1000 for p in (0.5, 0.9, 0.99)}
    print(f"/tokenize under load ({len(seconds)} probes): {q[0.5]:.2f} ms median, {q[0.9]:.2f} p90, {q[0.99]:.2f} p99; "
          f"the load: {load['output_tok_s']:.1f} tok/s, TTFT {load['ttft_ms_median']:.0f} ms median "
          f"({load['ttft_ms_p99']:.0f} p99), ITL {load['itl_ms_median']:.1f} ms median ({load['itl_ms_p99']:.1f} p99)")


if __name__ == "__main__":
    main()
