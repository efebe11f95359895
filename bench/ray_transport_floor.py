"""The floor under `linnet serve --ray`'s hop: one request's round trip over Ray's actor calls against
one over HTTP, on this machine, with nothing but the transport in the way.

Side by side in one run, one request at a time, a 300-byte argument each way, 400 round trips per
transport after 20 to warm up:
- a Ray actor's async method (`await actor.method.remote(...)`), and an async generator method
  streamed (`num_returns="streaming"`), which is how a deployment handle reaches a replica;
- HTTP/1.1 with keep-alive to a FastAPI app on uvicorn in another process, through aiohttp's client
  and through httpx's, both on uvloop (how the front would reach a replica serving HTTP itself).
Prints each one's median, p90 and p99 in ms; --save writes them as JSON with the machine. Needs
`pip install 'linnet[ray]'` (Ray Serve brings aiohttp and uvloop).

    python bench/ray_transport_floor.py --save bench/results/serving_ray/transport-floor.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linnet_core.bench.machine import environment  # noqa: E402
from linnet_core.serve import free_port  # noqa: E402

PAYLOAD = b"x" * 300
WARMUP, ROUNDS = 20, 400
SERVER = """
import sys, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
app = FastAPI()
@app.post("/echo")
async def echo(request: Request):
    return Response(await request.body())
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def quantiles(seconds: list[float]) -> dict[str, float]:
    """As the serving bench takes them (numpy's percentiles), in ms."""
    p50, p90, p99 = (1000 * float(v) for v in np.percentile(seconds, [50, 90, 99]))
    return {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "n": len(seconds)}


async def timed(call) -> dict[str, float]:
    for _ in range(WARMUP):
        await call()
    seconds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - t0)
    return quantiles(seconds)


async def over_ray() -> dict[str, dict]:
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        async def call(self, body: bytes) -> bytes:
            return body

        async def stream(self, body: bytes):
            yield body

    actor = Echo.remote()

    async def call():
        await actor.call.remote(PAYLOAD)

    async def stream():
        async for ref in actor.stream.options(num_returns="streaming").remote(PAYLOAD):
            await ref

    return {"ray actor call": await timed(call), "ray actor stream": await timed(stream)}


async def over_http(port: int) -> dict[str, dict]:
    import aiohttp
    import httpx

    url = f"http://127.0.0.1:{port}/echo"
    out = {}
    async with aiohttp.ClientSession() as session:
        async def aio():
            async with session.post(url, data=PAYLOAD) as r:
                await r.read()
        out["http, aiohttp client"] = await timed(aio)
    async with httpx.AsyncClient() as client:
        async def hx():
            (await client.post(url, content=PAYLOAD)).raise_for_status()
        out["http, httpx client"] = await timed(hx)
    return out


def wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the HTTP server did not listen on port {port} within {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="write the figures as JSON")
    args = ap.parse_args()
    import ray
    import uvloop

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        wait_listening(port)
        ray.init(include_dashboard=False, log_to_driver=False)
        results = uvloop.run(over_ray())
        results |= uvloop.run(over_http(port))
    finally:
        server.terminate()
        server.wait(10)
        ray.shutdown()
    for name, q in results.items():
        print(f"{name:24s} {q['p50_ms']:6.2f} ms median  {q['p90_ms']:6.2f} p90  {q['p99_ms']:6.2f} p99")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        record = {"environment": environment("cpu"), "rounds": ROUNDS, "payload_bytes": len(PAYLOAD),
                  "results": results}
        args.save.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.save}")


if __name__ == "__main__":
    main()
