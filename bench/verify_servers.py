"""`linnet verify --url` on a real checkpoint: a correct server and four broken ones, under `linnet serve`
and llama-server side by side, each with the diagnosis it got (docs/verify-servers.md's tables).

    python bench/make_qwen3_191m.py /tmp/qwen3-191m
    python bench/verify_servers.py /tmp/qwen3-191m --work /tmp/verify-servers [--servers linnet,llama-server]

The broken variants are made from Linnet's float32 GGUF of the model by tests/broken_servers.py;
llama-server runs with float32 attention (-ctk f32 -ctv f32 -fa off), so both are float32 claims.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def serve(kind: str, gguf: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """The server on `gguf`, ready; (its process, its URL)."""
    from server_fixtures import wait_healthy

    from linnet_core.bench import llama_server
    from linnet_core.serve import free_port

    if kind == "llama-server":
        proc, url, _ = llama_server.start(llama_server.require(), gguf, 1, 2048, 2, log,
                                          flags=llama_server.FLOAT32_ATTENTION)
        return proc, url
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "linnet_cli", "serve", str(gguf), "--dtype", "float32", "--port",
                             str(port), "--cache-len", "1024", "--rows", "2"], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    if not wait_healthy(f"http://127.0.0.1:{port}", 600):
        raise SystemExit(f"linnet serve on {gguf} did not start: see {log}")
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/verify-servers"))
    ap.add_argument("--servers", default="linnet,llama-server")
    args = ap.parse_args()

    import broken_servers

    from linnet_core.check.served import DEFAULT_PROMPTS, verify_server

    args.work.mkdir(parents=True, exist_ok=True)
    good = args.work / "correct.gguf"
    if not good.exists():
        subprocess.run([sys.executable, "-m", "linnet_cli", "export", "gguf", str(args.model), str(good), "--dtype",
                        "f32", "--no-check", "--quiet"], check=True)
    variants = {"correct": good, **broken_servers.make(args.model, good, args.work, list(DEFAULT_PROMPTS))}
    print("| server | variant | expected | diagnosis | max \\|Δ logprob\\| (completions) | verify's time |")
    print("|---|---|---|---|---|---|")
    for kind in args.servers.split(","):
        for name, gguf in variants.items():
            proc, url = serve(kind, gguf, args.work / f"{kind}-{gguf.stem}.log")
            try:
                t = time.perf_counter()
                r = verify_server(args.model, f"{url}/v1", dtype="float32")
                took = time.perf_counter() - t
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
            worst = max((c.max_dlogprob or 0.0) for c in r.comparisons if c.kind == "completion")
            print(f"| {kind} | {name} | {broken_servers.EXPECTED.get(name, 'PASS')} | "
                  f"{', '.join(r.diagnosis) or 'PASS'} | {worst:.3g} | {took:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
