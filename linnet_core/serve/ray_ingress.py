"""The ingress of a Linnet application on Ray (served by `ray_front`): `linnet serve`'s routes, each
request forwarded whole to a replica of the model it names, the answer passed back as the replica
sends it. A replica that dies before answering hands the request to another (twice at most, then a
503 with Retry-After); one that dies mid-stream ends the stream with an error event (OpenAI's shape,
which its SDK raises as an error) and `[DONE]`, so no client waits on a dead replica."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter, deque

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray.exceptions import ActorUnavailableError, RayActorError

from .http_common import RETRY_AFTER_S, ApiError, ApiKeyCheck, answer_errors, read_json_body
from .prefix_routing import placement, route_key
from .ray_board import board

POSTED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
ATTEMPTS = 3  # a replica that dies before answering: the request goes to another, twice at most
OVERHEAD_SAMPLES = 10_000  # the latest forwarding overheads, for /metrics' quantiles
DROPPED_HEADERS = {b"authorization", b"content-length", b"transfer-encoding", b"connection"}


class Ingress:
    """The application's HTTP face: `linnet serve`'s routes, each model's requests forwarded to its
    deployment through `handles` (streaming deployment handles, one per model)."""

    def __init__(self, handles: dict, app_name: str, api_key: str | None, max_body_bytes: int):
        self.handles = handles
        self.closing = False  # the application is being deleted: new requests get a 503
        self.app_name, self.api_key, self.max_body_bytes = app_name, api_key, max_body_bytes
        self.started = int(time.time())
        self.overheads: deque[float] = deque(maxlen=OVERHEAD_SAMPLES)
        self.overhead_total, self.forwarded = 0.0, 0
        self.placed = {name: Counter() for name in handles}  # per model: owner, spilled, unkeyed
        self.board = board(app_name)

    def handle_for(self, model) -> tuple[str, object]:
        """The model a request names (the first one when it names none)."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", code="service_unavailable", kind="server_error")
        if isinstance(model, str) and model in self.handles:
            return model, self.handles[model]
        if model is None or len(self.handles) == 1:  # one model: a wrong name is answered by its replica, as alone
            name = next(iter(self.handles))
            return name, self.handles[name]
        raise ApiError(404, f"the model '{model}' does not exist; this server has "
                            f"{', '.join(repr(n) for n in self.handles)}", "model", "model_not_found")

    def observe(self, model: str, start: dict, seconds: float) -> None:
        """A forwarded request's answer began: what the hop cost, and whether its prefix's owner took it."""
        self.overheads.append(seconds)
        self.overhead_total += seconds
        self.forwarded += 1
        self.placed[model][placement(start["owner"], start["replica"])] += 1

    def key(self, path: str, body) -> str | None:
        if path in ("/v1/completions", "/v1/chat/completions"):
            return route_key(body, chat=path.endswith("chat/completions"))
        return None


def deployment_name(model: str) -> str:
    return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model)


def ingress_app(ing: Ingress):
    app = FastAPI(title="Linnet on Ray", docs_url=None, redoc_url=None, openapi_url=None)
    answer_errors(app)

    @app.get("/health")
    async def health():
        if ing.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok", "models": list(ing.handles)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": ing.started, "owned_by": "linnet"}
                                           for n in ing.handles]}

    @app.get("/metrics")
    async def metrics():
        try:
            entries = await ing.board.read.remote()
        except RayActorError:  # the deploying process has gone and took the board: this front's own alone
            entries = {}
        return PlainTextResponse(metrics_text(ing, entries), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        return await forward(request, b"", None, request.query_params.get("model"))

    async def posted(request: Request):
        raw = await read_json_body(request, ing.max_body_bytes)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # forwarded all the same: the replica answers it in `linnet serve`'s words
        model = body.get("model") if isinstance(body, dict) else None
        return await forward(request, raw, ing.key(request.url.path, body), model)

    for path in POSTED:
        app.add_api_route(path, posted, methods=["POST"])

    async def forward(request: Request, raw: bytes, key: str | None, model):
        name, handle = ing.handle_for(model)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in DROPPED_HEADERS]
        sent = time.perf_counter()
        for attempt in range(ATTEMPTS):
            stream = handle.forward.remote(request.method, request.url.path, request.url.query, headers, raw,
                                           route_key=key)
            try:
                start = await stream.__anext__()
                break
            except asyncio.CancelledError:  # the client left while the replica worked
                stream.cancel()
                raise
            except (RayActorError, ActorUnavailableError) as e:  # nothing was sent yet: another replica may take it
                stream.cancel()
                if attempt == ATTEMPTS - 1:
                    raise ApiError(503, f"the replicas serving '{name}' failed before answering "
                                        f"({type(e).__name__}); retry", code="replica_failed",
                                   kind="server_error") from None
        ing.observe(name, start, max(0.0, time.perf_counter() - sent - start["seconds"]))
        out = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
               if k.lower() not in DROPPED_HEADERS}
        out["x-linnet-replica"] = start["replica"]
        if "body" in start:  # the whole response in one message
            stream.cancel()
            return Response(start["body"], status_code=start["status"], headers=out)
        return StreamingResponse(_events(stream, name), status_code=start["status"], headers=out)

    return ApiKeyCheck(app, ing.api_key) if ing.api_key else app


async def _events(stream, name: str):
    try:
        async for part in stream:
            yield part
    except Exception as e:  # noqa: BLE001 - the replica died mid-stream: say so, then end the stream
        error = {"error": {"message": f"the replica serving '{name}' failed mid-stream ({type(e).__name__}); "
                                      "retry the request", "type": "server_error", "param": None,
                           "code": "replica_failed"}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        stream.cancel()  # the client left (or the stream ended): the replica frees the request's row


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(ing, entries: dict[str, dict]) -> str:
    """The front's own metrics, then every live replica's, each sample labelled with its model and
    replica (one HELP and TYPE per metric)."""
    lines = ["# HELP linnet_ray_replicas Live replicas, by model.", "# TYPE linnet_ray_replicas gauge"]
    for name in ing.handles:
        lines.append(f'linnet_ray_replicas{{model="{_label(name)}"}} '
                     f'{sum(e["model"] == name for e in entries.values())}')
    lines += ["# HELP linnet_ray_routed_total Requests placed, by model and how: on the replica that owns their "
              "prefix, spilled past it (busy), or unkeyed (no prompt).", "# TYPE linnet_ray_routed_total counter"]
    for name, counts in ing.placed.items():
        lines += [f'linnet_ray_routed_total{{model="{_label(name)}",placement="{how}"}} {counts.get(how, 0)}'
                  for how in ("owner", "spilled", "unkeyed")]
    samples = sorted(ing.overheads)
    lines += ["# HELP linnet_ray_forward_overhead_seconds What the front adds to a request: its time to the "
              "replica's first answer less the replica's own (the latest 10,000 requests' quantiles).",
              "# TYPE linnet_ray_forward_overhead_seconds summary"]
    for q in (0.5, 0.9, 0.99):
        value = samples[min(len(samples) - 1, int(q * len(samples)))] if samples else float("nan")
        lines.append(f'linnet_ray_forward_overhead_seconds{{quantile="{q}"}} {value}')
    lines += [f"linnet_ray_forward_overhead_seconds_sum {ing.overhead_total}",
              f"linnet_ray_forward_overhead_seconds_count {ing.forwarded}"]
    families: dict[str, dict[str, list[str]]] = {}
    for replica, entry in sorted(entries.items()):
        labels = f'model="{_label(entry["model"])}",replica="{_label(replica)}"'
        family = None
        for line in entry["metrics"].splitlines():
            if line.startswith("# "):
                family = line.split(" ", 3)[2]
                head = families.setdefault(family, {"head": [], "samples": []})["head"]
                if line not in head:
                    head.append(line)
            elif line and family is not None:
                name, _, value = line.rpartition(" ")
                name = name.replace("{", "{" + labels + ",", 1) if "{" in name else f"{name}{{{labels}}}"
                families[family]["samples"].append(f"{name} {value}")
    for family in families.values():
        lines += family["head"] + family["samples"]
    return "\n".join(lines) + "\n"
