"""The OpenAI-compatible HTTP face of the engine (FastAPI on uvicorn; `pip install 'linnet[serve]'`).

`POST /v1/completions` and `/v1/chat/completions` (streamed as Server-Sent Events ending with
`data: [DONE]`), `GET /v1/models`, `/health` and `/metrics` (Prometheus text). Every bad request
is a 4xx in OpenAI's error shape, never a 500; a client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import (
    Request,  # at module level: the handlers' annotations are resolved from here
)

from ..errors import InputError, LinnetError
from ..runtime.sampling import SamplingParams
from ..tokenizer import Tokenizer
from . import Mailbox
from .engine import Delta, Engine, EngineFull, GenerationRequest, Handle

HISTOGRAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    default_max_tokens: int = 16


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default: float, low: float | None = None, high: float | None = None,
            integer: bool = False, low_open: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise ApiError(400, f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise ApiError(400, f"'{name}' must be <= {high}, got {value}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return tuple(s for s in stop if s)
    raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", "stop")


class Server:
    """Requests in, engine handles out: parsing, validation and the response shapes."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, model_name: str, limits: Limits = Limits()):
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.started = int(time.time())
        self._mailbox: Mailbox | None = None

    def mailbox(self) -> Mailbox:
        """The running loop's mailbox (the server runs on one loop)."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    # -- parsing ----------------------------------------------------------------------------
    def parse(self, raw: bytes) -> dict:
        if len(raw) > self.limits.max_body_bytes:
            raise ApiError(413, f"the body is {len(raw)} bytes; the limit is {self.limits.max_body_bytes}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server has '{self.model_name}'", "model",
                           "model_not_found")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        return body

    def request(self, body: dict, prompt: list[int]) -> GenerationRequest:
        max_tokens = _number(body, "max_tokens", self.limits.default_max_tokens, 1, self.limits.max_tokens,
                             integer=True)
        if "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, self.limits.max_tokens, integer=True)
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be true or false", "ignore_eos")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "'seed' must be an integer", "seed")
        sampling = SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                                  top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
                                  top_k=int(_number(body, "top_k", 0, 0, integer=True)), seed=seed)
        return GenerationRequest(prompt, max_tokens, sampling, _stop(body), tuple(ids), ignore_eos)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return self._encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                       "prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI's content parts: text only here
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ApiError(400, f"messages[{i}]: only text content is supported", "messages")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            clean.append({"role": m["role"], "content": content})
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so it takes token ids on /v1/completions only")
        try:
            return self.tokenizer.apply_chat_template(clean)
        except LinnetError as e:
            raise ApiError(400, e.message, "messages") from None

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", "prompt")
        return self.tokenizer.encode(text)

    def submit(self, request: GenerationRequest) -> Handle:
        try:
            return self.engine.submit(request)
        except EngineFull as e:
            raise ApiError(429, e.message, code="rate_limit_exceeded", kind="rate_limit_error") from None
        except InputError as e:
            raise ApiError(400, e.message) from None

    # -- responses --------------------------------------------------------------------------
    def usage(self, handle: Handle) -> dict:
        st = handle.stats
        return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.completion_tokens,
                "total_tokens": st.prompt_tokens + st.completion_tokens}

    def metrics_text(self) -> str:
        e, m = self.engine, self.engine.metrics
        lines = [
            "# HELP linnet_requests_running Requests holding a cache row.", "# TYPE linnet_requests_running gauge",
            f"linnet_requests_running {e.running}",
            "# HELP linnet_requests_waiting Requests queued for a row.", "# TYPE linnet_requests_waiting gauge",
            f"linnet_requests_waiting {e.waiting}",
            "# HELP linnet_rows_in_use Cache rows in use.", "# TYPE linnet_rows_in_use gauge",
            f"linnet_rows_in_use {e.running}",
            "# HELP linnet_rows Cache rows.", "# TYPE linnet_rows gauge", f"linnet_rows {e.rows}",
            "# HELP linnet_requests_total Requests accepted.", "# TYPE linnet_requests_total counter",
            f"linnet_requests_total {m['requests_total']}",
            "# HELP linnet_generated_tokens_total Tokens generated.", "# TYPE linnet_generated_tokens_total counter",
            f"linnet_generated_tokens_total {m['tokens_generated']}",
        ]
        for name, values, what in (("linnet_time_to_first_token_seconds", m["ttft_s"], "Time to first token."),
                                   ("linnet_inter_token_seconds", m["inter_token_s"], "Time between tokens.")):
            lines += [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
            for b in HISTOGRAM_BUCKETS:
                lines.append(f'{name}_bucket{{le="{b}"}} {sum(v <= b for v in values)}')
            lines += [f'{name}_bucket{{le="+Inf"}} {len(values)}', f"{name}_sum {sum(values)}",
                      f"{name}_count {len(values)}"]
        return "\n".join(lines) + "\n"


def _deltas(handle: Handle, mailbox: Mailbox) -> asyncio.Queue:
    """The handle's deltas, delivered into the event loop from the engine's thread."""
    q: asyncio.Queue[Delta] = asyncio.Queue()
    handle.subscribe(lambda d: mailbox.post(q, d))
    return q


def create_app(server: Server, api_key: str | None = None, drain_timeout: float = 30.0):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        yield
        # SIGTERM: uvicorn has stopped taking requests; let those in flight finish, then go.
        await asyncio.get_running_loop().run_in_executor(None, server.engine.stop, drain_timeout)

    app = FastAPI(title="Linnet", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind=kind).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return JSONResponse(ApiError(400, "the request is malformed").body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request, e):  # a bug: still an OpenAI-shaped error, never a bare 500 page
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(),
                            status_code=500)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key",
                             kind="authentication_error")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.started,
                                            "owned_by": "linnet"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        body = server.parse(await request.body())
        prompt = server.chat_prompt(body) if chat else server.completion_prompt(body)
        handle = server.submit(server.request(body, prompt))
        deltas = _deltas(handle, server.mailbox())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, reason: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

        if body.get("stream"):
            async def events():
                first = True
                try:
                    while True:
                        d = await deltas.get()
                        chunk = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                                 "model": server.model_name, "choices": [choice(d.text, d.finish_reason, first)]}
                        first = False
                        if d.finish_reason is not None:
                            chunk["usage"] = server.usage(handle)
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if d.finish_reason is not None:
                            break
                    yield "data: [DONE]\n\n"
                finally:  # the client left (or the stream ended): free the row
                    handle.cancel()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, reason = [], None
        try:
            while reason is None:
                d = await deltas.get()
                text.append(d.text)
                reason = d.finish_reason
        finally:
            handle.cancel()
        content = "".join(text)
        out = {"index": 0, "finish_reason": reason, "logprobs": None}
        out.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
        return {"id": rid, "object": kind, "created": created, "model": server.model_name, "choices": [out],
                "usage": server.usage(handle)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app
