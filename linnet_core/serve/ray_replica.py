"""A replica of a Linnet application on Ray: one engine, running `linnet serve`'s own app in-process
(`asgi_call`) on the requests the front forwards. Loaded in the replicas' processes only: it
brings torch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
import torch
from ray import serve

from .asgi_call import asgi_call
from .config import ServeConfig
from .fields import prompt_char_limit
from .http import Limits, Server, create_app
from .launch import launch
from .ray_board import Reporter


@dataclass(frozen=True)
class ModelSpec:
    """One model of the application: its name in the API, how it loads, its largest max_tokens."""

    name: str
    config: ServeConfig
    max_tokens: int | None = None


class ModelReplica:
    """One engine, serving `linnet serve`'s own app to the requests the front forwards."""

    def __init__(self, spec: ModelSpec, threads: int, app_name: str, drain_timeout: float):
        torch.set_num_threads(threads)  # the replica's own process: as many threads as it holds CPUs
        served = launch(spec.config)
        n = served.session.cache_len
        limits = Limits(max_tokens=min(spec.max_tokens or n, n), max_prompt_chars=prompt_char_limit(n))
        self.server = Server(served.engine, served.tokenizer, spec.name, limits)
        self.app = create_app(self.server)
        self.drain_timeout = drain_timeout
        served.engine.start()
        self.id = serve.get_replica_context().replica_id.unique_id
        entry = {"model": spec.name, "actor": ray.get_runtime_context().get_actor_name()}
        self.reporter = Reporter(app_name, self.id, entry, self.server.metrics_text)
        self.reporter.start()

    async def forward(self, method: str, path: str, query: str, headers: list, body: bytes,
                      route_key: str | None = None, owner: str | None = None):
        """The response's start ({"status", "headers", "replica", "owner", "seconds"}: the time it took
        here), then its body's chunks as they come if it is an event stream; any other response is one
        item, its start with its whole "body" (one message back, not two). `route_key` is for the
        router, which sets `owner` from it."""
        started = time.perf_counter()
        whole, parts = None, []
        async for item in asgi_call(self.app, method, path, query, headers, body):
            if isinstance(item, dict):
                item.update(replica=self.id, owner=owner)
                if not _event_stream(item["headers"]):
                    whole = item
                    continue
                item["seconds"] = time.perf_counter() - started
            if whole is None:
                yield item
            else:
                parts.append(item)
        if whole is not None:
            yield {**whole, "body": b"".join(parts), "seconds": time.perf_counter() - started}

    def __del__(self):  # Ray Serve calls it once the replica's requests are done (or the drain timed out)
        if hasattr(self, "reporter"):
            self.reporter.stop()
            self.server.engine.stop(self.drain_timeout)


def _event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
