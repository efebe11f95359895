"""The front of a Linnet application on Ray: its OpenAI-compatible HTTP server (`ray_ingress`'s app on
uvicorn, behind `linnet serve`'s connection guard), run in the process that deployed the application
and calling each model's replicas straight through the model's deployment handle.

Why not Ray Serve's HTTP proxy with an ingress deployment behind it: that is two actor hops before a
replica sees a request; on the 2-core bench machine an idle /tokenize took 9-11 ms through them and
3 ms through the front, against 0.9 ms straight to a server (bench/serving_ray.py, docs/serving.md).
It is also how the routers people put before LLM replicas are built (llm-d's gateway, SGLang's
router): one process, one hop.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading

import uvicorn
from ray.serve.handle import DeploymentHandle

from ..errors import BackendUnavailable, InputError
from .guard import ConnectionLimits, uvicorn_options
from .ray_ingress import Ingress, ingress_app

START_TIMEOUT_S = 30.0


def fast_handle(deployment: str, app: str) -> DeploymentHandle:
    """A handle whose router runs on the caller's loop (call it on the loop that will use it), not
    Serve's cached one: the front shuts it down with its loop. Its requests go with
    `.options(stream=True, _by_reference=False)` (gRPC): Ray Serve's throughput-optimized settings,
    for this handle only (a hop of 2.5 ms median here, 4.9 ms with Serve's defaults)."""
    handle = DeploymentHandle(deployment, app)
    handle._init(_run_router_in_separate_loop=False)
    return handle


class Front:
    """The HTTP server in a thread of its own with its own event loop; `start` returns once it
    listens, `stop` ends it (streams in flight finish within the graceful timeout)."""

    def __init__(self, deployments: dict[str, tuple[str, str]], app_name: str, host: str, port: int,
                 api_key: str | None = None, max_body_bytes: int = 1 << 20, max_connections: int = 1024,
                 per_peer: int | None = None, graceful_s: float = 30.0):
        self.deployments = deployments  # model name -> (deployment, application) on Ray Serve
        self.app_name, self.api_key, self.max_body_bytes = app_name, api_key, max_body_bytes
        self.host, self.port, self.graceful_s = host, port, graceful_s
        self.limits = ConnectionLimits(per_peer=per_peer or max(1, max_connections // 2))
        self.max_connections = max_connections
        self.ingress: Ingress | None = None
        self.server: uvicorn.Server | None = None
        self.failure: BaseException | None = None
        self.socket: socket.socket | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="linnet-ray-front", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def bind(self) -> Front:
        """Take the port (before anything deploys: a taken port is one line, not a log line of uvicorn's)."""
        try:
            self.socket = socket.create_server((self.host, self.port), family=_family(self.host))
        except OSError as e:
            raise InputError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = self.socket.getsockname()[1]  # port 0: the one the system gave
        return self

    def start(self) -> Front:
        self.thread.start()
        if not self.ready.wait(START_TIMEOUT_S) or self.failure is not None:
            self.stop()
            why = f"{type(self.failure).__name__}: {self.failure}" if self.failure else "timed out"
            raise BackendUnavailable(f"the HTTP front did not start on {self.host}:{self.port} ({why})")
        # what start-up made (torch, Ray, the app) lives as long as the process: frozen, the collector
        # stops walking it on a request's path (the hop's p99 went from 6.5 to 4.5 ms here)
        gc.collect()
        gc.freeze()
        return self

    def _run(self) -> None:
        try:
            loop = _new_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._serve())
            loop.close()
        except BaseException as e:  # noqa: BLE001 - reported to start(), which raises it in one line
            self.failure = e
            self.ready.set()

    async def _serve(self) -> None:
        handles = {name: fast_handle(deployment, app) for name, (deployment, app) in self.deployments.items()}
        streaming = {name: h.options(stream=True, _by_reference=False) for name, h in handles.items()}
        self.ingress = Ingress(streaming, self.app_name, self.api_key, self.max_body_bytes)
        config = uvicorn.Config(ingress_app(self.ingress), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=int(self.graceful_s) + 1,
                                **uvicorn_options(self.limits, self.max_body_bytes, self.max_connections))
        self.server = uvicorn.Server(config)
        serving = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if serving.done():
                serving.result()  # raises what stopped it
                raise RuntimeError("the server stopped while starting")
            await asyncio.sleep(0.01)
        self.ready.set()
        try:
            await serving
        finally:
            for handle in handles.values():  # their routers live on this loop: stop them before it closes
                await handle.shutdown_async()

    def refuse_new(self) -> None:
        """From now on requests get a 503 (the application is going); those in flight go on."""
        if self.ingress is not None:
            self.ingress.closing = True

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(self.graceful_s + 5)
        if self.socket is not None:
            self.socket.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's C event loop where it is installed, as uvicorn picks it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
