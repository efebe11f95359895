"""The OpenAI-compatible HTTP face of the engine (FastAPI on uvicorn; `pip install 'linnet[serve]'`).

`POST /v1/completions` and `/v1/chat/completions` (streamed as Server-Sent Events ending with
`data: [DONE]`; logprobs, echo, n, best_of, penalties, logit_bias, min_p, stream_options),
`/tokenize`, `/detokenize` and `/tokenizer_info` (vLLM's and llama-server's), `GET /v1/models`, `/health` and
`/metrics` (Prometheus text). Every bad request is a 4xx in OpenAI's error shape, never a 500; a client that disconnects cancels its request,
streaming or not. A body is refused past its limit before it is read (Content-Length) or while it is
read (chunked); tokenization and chat templates run off the event loop, after the queue's limit is
checked, on text capped in characters.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import (
    Request,  # at module level: the handlers' annotations are resolved from here
)

from ..errors import InputError, LinnetError
from ..runtime.constraints import GrammarSpec
from ..runtime.sampling import TokenLogprobs
from ..tokenizer import Tokenizer
from . import Mailbox
from .engine import (
    Delta,
    Engine,
    EngineFull,
    EngineUnavailable,
    GenerationRequest,
    Handle,
)
from .fields import (
    SEED_RANGE,
    FieldError,
    choice_counts,
    flag,
    generation_request,
    grammar_compiler,
    parse_json,
)
from .http_common import (
    RETRY_AFTER_S,
    ApiError,
    ApiKeyCheck,
    answer_errors,
    read_json_body,
)
from .logprobs import TokenNames, chat_content, completion_logprobs, cumulative
from .tools import CallStream, ToolFormat, ToolRequest, format_for, tool_request

MAX_BATCH = 64  # prompts in one completions request


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    default_max_tokens: int = 16  # completions' default, as OpenAI's; chat's is the rest of the context
    max_prompt_chars: int = 1 << 18  # text longer than this is refused before it is tokenized


@dataclass(frozen=True)
class Choices:
    """A request's engine requests, `best_of` per prompt in order, and how its answer is made of them."""

    requests: list[GenerationRequest]
    n: int
    best_of: int
    logprobs: bool  # whether the client asked for them (best_of > n computes them anyway, to rank)
    echoed: list[str] | None = None  # per request, the prompt text `echo` puts before the answer

    def chosen(self, logprobs: list[list[TokenLogprobs]]) -> list[int]:
        """The requests answered, in the choices' order: per prompt, all of them (n == best_of) or
        the n of highest cumulative log-probability, likeliest first (as vLLM orders best_of)."""
        if self.best_of == self.n:
            return list(range(len(self.requests)))
        out = []
        for start in range(0, len(self.requests), self.best_of):
            group = range(start, start + self.best_of)
            out += sorted(group, key=lambda i: -cumulative(logprobs[i]))[:self.n]
        return out


class Server:
    """Requests in, engine handles out: parsing, validation and the response shapes."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, model_name: str, limits: Limits = Limits()):
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.started = int(time.time())
        self.compile_grammar = grammar_compiler(tokenizer, engine)
        self._mailbox: Mailbox | None = None

    def mailbox(self) -> Mailbox:
        """The running loop's mailbox (the server runs on one loop)."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    # -- parsing ----------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        return await read_json_body(request, self.limits.max_body_bytes)

    def parse(self, raw: bytes) -> dict:
        if len(raw) > self.limits.max_body_bytes:
            raise ApiError(413, f"the body is {len(raw)} bytes; the limit is {self.limits.max_body_bytes}")
        try:
            body = parse_json(raw)
        except FieldError as e:
            raise ApiError(400, e.message) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server has '{self.model_name}'", "model",
                           "model_not_found")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        return body

    def request(self, body: dict, prompt: list[int], chat: bool = False,
                tool_grammar: GrammarSpec | None = None) -> GenerationRequest:
        if chat and body.get("echo") not in (None, False):
            raise ApiError(400, "'echo' is a field of completions, not of chat", "echo")
        if not chat and body.get("tools"):
            raise ApiError(400, "'tools' is a field of chat completions", "tools")
        # chat's default max_tokens is the rest of the context, as OpenAI's; completions' is 16
        default = self.engine.cache_len - len(prompt) if chat else self.limits.default_max_tokens
        try:
            return generation_request(body, prompt, default_max_tokens=max(1, min(default, self.limits.max_tokens)),
                                      max_tokens_limit=self.limits.max_tokens, vocab_size=self.engine.session.vocab_size,
                                      compile_grammar=self.compile_grammar, tool_grammar=tool_grammar)
        except FieldError as e:
            raise ApiError(400, e.message, e.param) from None
        except InputError as e:
            raise ApiError(400, e.message) from None

    def stream_options(self, body: dict) -> tuple[bool, bool]:
        """(stream, include_usage): `stream_options` only with `stream`, as OpenAI has it."""
        stream, options = bool(body.get("stream")), body.get("stream_options")
        if options is None:
            return stream, False
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
        return stream, options.get("include_usage", False)

    def plan(self, body: dict, prompts: list[list[int]], chat: bool, stream: bool,
             texts: list[str | list[int]] | None = None, tool_grammar: GrammarSpec | None = None,
             keep_special: bool = False) -> Choices:
        """The engine requests for `prompts`: `best_of` per prompt (each its own sampler stream: seed,
        seed + 1, ...), of which the `n` likeliest are answered. `texts`: the prompts as sent, which
        `echo` returns (ids are decoded)."""
        try:
            n, best_of = choice_counts(body, self.engine.rows)
        except FieldError as e:
            raise ApiError(400, e.message, e.param) from None
        if best_of > n and stream:
            raise ApiError(400, "'best_of' above 'n' cannot be streamed (the choices are picked at the end)", "best_of")
        requests, asked, echoed = [], None, []
        for prompt, sent in zip(prompts, texts or [None] * len(prompts), strict=True):
            base = self.request(body, prompt, chat, tool_grammar)
            if keep_special:
                base = replace(base, skip_special_tokens=False)
            asked = base.sampling.logprobs
            if best_of > n and asked is None:  # ranked by their log-probability, which is then computed
                base = replace(base, sampling=replace(base.sampling, logprobs=0))
            if base.prompt_logprobs is not None:
                echoed += [sent if isinstance(sent, str) else self._decode(prompt)] * best_of
            for j in range(best_of):
                seed = base.sampling.seed
                seed = None if seed is None else (seed + j if seed + j < SEED_RANGE[1] else seed - j)
                requests.append(base if j == 0 else replace(base, sampling=replace(base.sampling, seed=seed)))
        return Choices(requests, n, best_of, logprobs=asked is not None, echoed=echoed or None)

    def ids_asked(self, body: dict) -> bool:
        try:
            return flag(body, "return_tokens_as_token_ids")
        except FieldError as e:
            raise ApiError(400, e.message, e.param) from None

    @functools.cached_property
    def token_names(self) -> TokenNames:
        return TokenNames(self.tokenizer)

    def completion_prompts(self, body: dict) -> list[str | list[int]]:
        """The request's prompts, still text or already ids: a string, a list of ids, or a batch of
        either (OpenAI's and vLLM's list of prompts, one choice each)."""
        prompt = body.get("prompt")
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_BATCH:
            raise ApiError(400, f"'prompt' holds {len(batch)} prompts; the limit is {MAX_BATCH}", "prompt")
        for p in batch:
            if isinstance(p, str) and p:
                self._check_text(len(p), "prompt")
                continue
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                continue
            raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of either",
                           "prompt")
        return batch

    def tokenize(self, body: dict) -> list[int]:
        if "messages" in body:
            return self.render_chat(self.chat_messages(body))
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise ApiError(400, "'prompt' must be a string (or send chat 'messages')", "prompt")
        self._check_text(len(text), "prompt")
        add = body.get("add_special_tokens", body.get("add_special", True))
        if not isinstance(add, bool):
            raise ApiError(400, "'add_special_tokens' must be true or false", "add_special_tokens")
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add)

    def detokenize(self, body: dict) -> str:
        ids = body.get("tokens")
        vocab = self.engine.session.vocab_size
        if (not isinstance(ids, list) or len(ids) > self.limits.max_prompt_chars
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        return self.tokenizer.decode(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else self._encode(prompt)

    def _check_text(self, chars: int, param: str) -> None:
        if chars > self.limits.max_prompt_chars:
            raise ApiError(400, f"the prompt is {chars} characters; the limit is {self.limits.max_prompt_chars}",
                           param)

    def chat_messages(self, body: dict) -> list[dict]:
        """The conversation as the template reads it: text content, an assistant's `tool_calls` (their
        arguments as objects, as templates write them) and a tool's answer with its `tool_call_id`."""
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
            calls = m.get("tool_calls")
            if content is None and (calls or m["role"] == "assistant"):
                content = ""  # an assistant turn that only called tools
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            out = {"role": m["role"], "content": content}
            if calls:
                out["tool_calls"] = [self._past_call(i, c) for c in (calls if isinstance(calls, list) else [None])]
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    out[key] = m[key]
            clean.append(out)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so it takes token ids on /v1/completions only")
        self._check_text(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in clean), "messages")
        return clean

    @staticmethod
    def _past_call(i: int, call) -> dict:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls must hold {{\"function\": {{\"name\", \"arguments\"}}}}",
                           "messages")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # the template writes it as the client sent it
        return {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(messages, tools)
        except LinnetError as e:
            raise ApiError(400, e.message, "messages") from None

    def tool_plan(self, body: dict) -> tuple[ToolRequest | None, ToolFormat | None, GrammarSpec | None, bool]:
        """The request's tools, the format the model's template writes calls in, the grammar a
        `required` or named `tool_choice` holds the answer to, and whether the format's marker is a
        special token (then special tokens stay in the text, where the parser finds it)."""
        try:
            tools = tool_request(body)
        except FieldError as e:
            raise ApiError(400, e.message, e.param) from None
        if tools is None:
            return None, None, None, False
        fmt = format_for(self.tokenizer.chat_template if self.tokenizer else None)
        if fmt is None:
            raise ApiError(400, "this model's chat template writes no tool calls Linnet reads (it reads Qwen's and "
                                "Hermes' <tool_call>, Mistral's [TOOL_CALLS], Phi-4-mini's functools[...] and Llama 3.1's JSON calls)",
                           "tools")
        marker = self.tokenizer.encode(fmt.marker, add_special_tokens=False) if fmt.marker else []
        special = len(marker) == 1 and marker[0] in self.tokenizer.special_ids()
        return tools, fmt, tools.grammar(fmt, marker if special and fmt.open else []), special

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", "prompt")
        return self.tokenizer.encode(text)

    def check_capacity(self) -> None:
        try:
            self.engine.check_capacity()
        except (EngineFull, EngineUnavailable) as e:
            raise _capacity_error(e) from None

    def submit(self, request: GenerationRequest) -> Handle:
        try:
            return self.engine.submit(request)
        except (EngineFull, EngineUnavailable) as e:
            raise _capacity_error(e) from None
        except InputError as e:
            raise ApiError(400, e.message) from None

    # -- responses --------------------------------------------------------------------------
    def usage(self, handles: list[Handle]) -> dict:
        prompt = sum(h.stats.prompt_tokens for h in handles)
        completion = sum(h.stats.completion_tokens for h in handles)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def metrics_text(self) -> str:
        e, m = self.engine, self.engine.metrics
        with m.lock:  # a consistent view; fixed-size histograms, so the lock is held for microseconds
            counters = (m.requests_total, m.tokens_generated, dict(m.finished_by_reason))
            prefix = (m.prompt_tokens, m.prefix_queries, m.prefix_hits, m.prefix_reused_tokens)
            drafts = (m.draft_proposed, m.draft_accepted, m.draft_checks)
            histograms = (m.ttft.render("linnet_time_to_first_token_seconds", "Time to first token."),
                          m.inter_token.render("linnet_inter_token_seconds", "Time between tokens."))
        total, generated, reasons = counters
        lines = [
            "# HELP linnet_requests_running Requests holding a cache row.", "# TYPE linnet_requests_running gauge",
            f"linnet_requests_running {e.running}",
            "# HELP linnet_requests_waiting Requests queued for a row.", "# TYPE linnet_requests_waiting gauge",
            f"linnet_requests_waiting {e.waiting}",
            "# HELP linnet_rows_in_use Cache rows in use.", "# TYPE linnet_rows_in_use gauge",
            f"linnet_rows_in_use {e.running}",
            "# HELP linnet_rows Cache rows.", "# TYPE linnet_rows gauge", f"linnet_rows {e.rows}",
            "# HELP linnet_requests_total Requests accepted.", "# TYPE linnet_requests_total counter",
            f"linnet_requests_total {total}",
            "# HELP linnet_requests_finished_total Requests ended, by finish reason.",
            "# TYPE linnet_requests_finished_total counter",
            *(f'linnet_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(reasons.items())),
            "# HELP linnet_generated_tokens_total Tokens generated.", "# TYPE linnet_generated_tokens_total counter",
            f"linnet_generated_tokens_total {generated}",
            "# HELP linnet_engine_healthy Whether the engine takes requests.", "# TYPE linnet_engine_healthy gauge",
            f"linnet_engine_healthy {int(e.healthy)}",
            "# HELP linnet_prompt_tokens_total Prompt tokens of the requests that took a row.",
            "# TYPE linnet_prompt_tokens_total counter", f"linnet_prompt_tokens_total {prefix[0]}",
            "# HELP linnet_prefix_cache_queries_total Requests looked up in the prefix cache.",
            "# TYPE linnet_prefix_cache_queries_total counter", f"linnet_prefix_cache_queries_total {prefix[1]}",
            "# HELP linnet_prefix_cache_hits_total Requests that found a prefix of their prompt cached.",
            "# TYPE linnet_prefix_cache_hits_total counter", f"linnet_prefix_cache_hits_total {prefix[2]}",
            "# HELP linnet_prefix_cache_reused_tokens_total Prompt positions taken from the cache, not computed.",
            "# TYPE linnet_prefix_cache_reused_tokens_total counter",
            f"linnet_prefix_cache_reused_tokens_total {prefix[3]}",
            "# HELP linnet_spec_decode_draft_tokens_total Tokens proposed by speculative decoding.",
            "# TYPE linnet_spec_decode_draft_tokens_total counter", f"linnet_spec_decode_draft_tokens_total {drafts[0]}",
            "# HELP linnet_spec_decode_accepted_tokens_total Proposed tokens the model kept.",
            "# TYPE linnet_spec_decode_accepted_tokens_total counter",
            f"linnet_spec_decode_accepted_tokens_total {drafts[1]}",
            "# HELP linnet_spec_decode_checks_total Drafts checked (a row's step over its proposed tokens).",
            "# TYPE linnet_spec_decode_checks_total counter", f"linnet_spec_decode_checks_total {drafts[2]}",
        ]
        for h in histograms:
            lines += h
        return "\n".join(lines) + "\n"


def _capacity_error(e: InputError) -> ApiError:
    if isinstance(e, EngineFull):
        return ApiError(429, e.message, code="rate_limit_exceeded", kind="rate_limit_error")
    return ApiError(503, e.message, code="service_unavailable", kind="server_error")


def _deltas(handles: list[Handle], mailbox: Mailbox) -> asyncio.Queue:
    """Every handle's deltas as (index, delta), delivered into the event loop from the engine's thread."""
    q: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
    for i, handle in enumerate(handles):
        handle.subscribe(lambda d, i=i: mailbox.post(q, (i, d)))
    return q


async def _until_disconnect(receive) -> None:
    """Return once the client has gone (the body is read by then, so the next message says so)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(server: Server, api_key: str | None = None, drain_timeout: float = 30.0):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        yield
        # SIGTERM: uvicorn has stopped taking requests; let those in flight finish, then go.
        await asyncio.get_running_loop().run_in_executor(None, server.engine.stop, drain_timeout)

    app = FastAPI(title="Linnet", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    answer_errors(app)

    @app.get("/health")
    async def health():
        engine = server.engine
        if not engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": "the engine stopped after an internal fault"},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        if engine.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.started,
                                            "owned_by": "linnet"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        body = server.parse(await server.read_body(request))
        server.check_capacity()  # a full queue refuses before any tokenizing is spent on the request
        stream, include_usage = server.stream_options(body)
        sent, tools, fmt, tool_grammar, keep_special = None, None, None, None, False
        if chat:
            messages = server.chat_messages(body)
            tools, fmt, tool_grammar, keep_special = server.tool_plan(body)
            shown, listed = fmt.place(messages, tools.tools) if tools else (messages, None)
            prompts = [await asyncio.to_thread(server.render_chat, shown, listed)]
        else:
            sent = server.completion_prompts(body)
            prompts = [await asyncio.to_thread(server.encode_prompt, p) for p in sent]
        as_ids = server.ids_asked(body)
        plan = await asyncio.to_thread(server.plan, body, prompts, chat, stream, sent, tool_grammar, keep_special)
        handles: list[Handle] = []
        try:
            for r in plan.requests:
                handles.append(server.submit(r))
        except ApiError:
            for h in handles:
                h.cancel()
            raise
        deltas = _deltas(handles, server.mailbox())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        # vLLM's `return_tokens_as_token_ids`: logprobs name tokens "token_id:N", which tells apart
        # tokens that decode alike (or to nothing) for a client that checks them by id
        names = TokenNames(None) if as_ids else server.token_names

        def cancel_all():
            for h in handles:
                h.cancel()

        def logprobs(items, offset: int = 0):
            if not plan.logprobs:
                return None
            if chat:
                return {"content": chat_content(names, items)}
            return completion_logprobs(names, items, offset)

        def chat_choices(i: int, text: str, lp, reason: str | None, first: bool) -> list[dict]:
            """One delta's chat chunks: its content (what is surely not a call), and at the end any
            calls as `delta.tool_calls` (each whole in one chunk) before the finish."""
            calls = []
            if calls_in is not None:
                text = calls_in[i].push(text)
                if reason is not None:
                    rest, calls = calls_in[i].finish()
                    text += rest
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            if not calls:
                return [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]
            listed = [{"index": k, **c.openai()} for k, c in enumerate(calls)]
            return [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None},
                    {"index": i, "delta": {"tool_calls": listed}, "logprobs": None, "finish_reason": None},
                    {"index": i, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]

        calls_in = [CallStream(fmt, tools.names) for _ in handles] if tools else None
        if stream:
            async def events():
                started, open_, offsets = set(), len(handles), [0] * len(handles)
                try:
                    while open_:
                        i, d = await deltas.get()
                        text, items = d.text, d.logprobs
                        if d.prompt_logprobs is not None:  # echo: the prompt and its scores come first
                            text, items = plan.echoed[i] + text, d.prompt_logprobs + items
                        lp = logprobs(items, offsets[i])
                        offsets[i] += len(text)
                        if chat:
                            choices = chat_choices(i, text, lp, d.finish_reason, i not in started)
                        else:
                            choices = [{"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}]
                        started.add(i)
                        open_ -= d.finish_reason is not None
                        for choice in choices:
                            chunk = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                                     "model": server.model_name, "choices": [choice]}
                            yield f"data: {json.dumps(chunk)}\n\n"
                    if include_usage:  # OpenAI's closing chunk: no choices, the request's usage
                        chunk = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                                 "model": server.model_name, "choices": [], "usage": server.usage(handles)}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client left (or the stream ended): free the rows
                    cancel_all()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts: list[list[str]] = [[] for _ in handles]
        lps: list[list] = [[] for _ in handles]
        scored: list[list] = [[] for _ in handles]  # echo: the prompt's own
        reasons: list[str | None] = [None] * len(handles)
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            while any(r is None for r in reasons):
                got = asyncio.ensure_future(deltas.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():  # the client hung up: cancel, and answer no one
                    got.cancel()
                    cancel_all()
                    return None
                i, d = got.result()
                texts[i].append(d.text)
                lps[i] += d.logprobs
                scored[i] += d.prompt_logprobs or []
                reasons[i] = d.finish_reason
        finally:
            gone.cancel()
            cancel_all()
        choices = []
        for index, i in enumerate(plan.chosen(lps)):
            out = {"index": index, "finish_reason": reasons[i], "logprobs": logprobs(scored[i] + lps[i])}
            text = (plan.echoed[i] if plan.echoed else "") + "".join(texts[i])
            if not chat:
                out["text"] = text
            elif tools and (found := fmt.parse(text, tools.names))[1]:
                out["message"] = {"role": "assistant", "content": found[0] or None,
                                  "tool_calls": [c.openai() for c in found[1]]}
                out["finish_reason"] = "tool_calls"
            else:
                out["message"] = {"role": "assistant", "content": text}
            choices.append(out)
        return {"id": rid, "object": kind, "created": created, "model": server.model_name, "choices": choices,
                "usage": server.usage(handles)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's and llama-server's: `prompt` (or `content`) text, or chat `messages` rendered by the
        template; the ids, their count and the context length."""
        body = server.parse(await server.read_body(request))
        ids = await asyncio.to_thread(server.tokenize, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.cache_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the special tokens and the chat template, with which clients (lm-eval's remote
        tokenizer) tokenize through /tokenize instead of loading the model's tokenizer themselves."""
        tok = server.tokenizer
        if tok is None:
            raise ApiError(404, "this model has no tokenizer", code="not_found", kind="not_found_error")
        return {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": server.engine.cache_len,
                "vocab_size": tok.vocab_size}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """Token ids back to text: `prompt` as vLLM answers, `content` as llama-server does."""
        body = server.parse(await server.read_body(request))
        text = await asyncio.to_thread(server.detokenize, body)
        return {"prompt": text, "content": text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return ApiKeyCheck(app, api_key) if api_key else app
