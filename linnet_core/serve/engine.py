"""Continuous batching over a session's fixed KV-cache rows.

Requests wait in a queue and are admitted into free rows. Each step is one `Session.step`: a token
for every decoding row, plus prompt chunks of the oldest prefilling rows, as many prompt tokens as
the step budget allows (`step_budget`: up to `prefill_chunk`, fewer while rows decode, so a long
prompt does not stall them) and the decode rows ride along with the prompt work (one pass over the
weights where the backend takes ragged steps). With no row decoding, the engine waits a moment while
requests keep arriving, so a burst is admitted together and its rows decode in step. A request is
placed in the row that already holds the longest prefix of its prompt (`prefix_cache`) and computes
only the rest. A request that finishes, stops or is cancelled frees its row at once. Each row's
computation is its own (the backends' batched steps are tested row-by-row against the row alone), so
a greedy answer does not depend on the load.

With speculative decoding (an `Engine(speculation=...)`), each decoding row first gets a draft from
the proposer (a draft model's steps batched over the rows), and the step checks every draft beside
the plain rows and prompt chunks: a row then advances by the accepted tokens and one of its own.

A fault is contained: a request whose output handling fails ends alone with finish reason "error"; a
step that fails is rerun one row at a time (the samplers' generators rewound first, so no other
row's seeded stream moves); anything else ends every request in flight and marks the engine
unhealthy, which `/health` and Triton's readiness report, instead of a dead thread that leaves every
request hanging.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError
from ..runtime.sampling import Sampler, SamplingParams, TokenLogprobs, logprobs_at
from ..runtime.session import Chunk, Session
from ..runtime.speculative import Speculation
from ..runtime.threads import release_openmp_pool
from ..tokenizer import IncrementalDecoder, Tokenizer
from .config import BURST_WAIT_CAP, BURST_WAIT_MS, DECODE_STALL, ServeConfig
from .metrics import EngineMetrics, Histogram
from .prefix_cache import PrefixCache
from .step_budget import StepBudget

log = logging.getLogger("linnet.serve")
PROBE_EVERY_S = 0.05  # how often a watched request's client is asked whether it has gone (an IPC for Triton)


class EngineFull(InputError):
    """Too many requests are waiting; the caller should retry later (HTTP 429)."""

    default_hint = "retry later, or raise the server's waiting limit"


class EngineUnavailable(InputError):
    """The engine takes no requests: shutting down, or broken by a fault (HTTP 503)."""

    default_hint = "retry against another replica"


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # the prompt's own log-probabilities, each with this many likeliest (echo): computed without the
    # prefix cache, sent in one delta before the first token; max_tokens may then be 0 (scoring only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # False: special tokens are text too (a tool-call marker that is one)
    draft_tokens: int | None = None  # speculative decoding: at most this many proposed a step (0: none; None: the server's)

    def __post_init__(self):
        # The engine's thread trusts these types; a face that builds a request wrongly fails here.
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) for x in self.stop):
            raise InputError("stop must be a tuple of strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise InputError("stop_token_ids must be a tuple of integers")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InputError("max_tokens must be an integer")
        if not isinstance(self.sampling, SamplingParams):
            raise InputError("sampling must be SamplingParams")
        if self.draft_tokens is not None and (isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int)
                                              or self.draft_tokens < 0):
            raise InputError("draft_tokens must be an integer of at least 0")


@dataclass
class Delta:
    """What one step added to a request's output; the last one carries the finish reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the prompt's, once (GenerationRequest.prompt_logprobs)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: Histogram = field(default_factory=Histogram)  # fixed size, however long the answer

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    def token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token.observe(now - self.last_token)
        self.last_token = now


class Handle:
    """A submitted request: iterate it for its deltas (blocking), or poll `get`; `cancel` stops it."""

    def __init__(self, rid: int, request: GenerationRequest):
        self.id, self.request = rid, request
        self.stats = RequestStats(prompt_tokens=len(request.prompt))
        self.finish_reason: str | None = None
        self._events: queue.Queue[Delta] = queue.Queue()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._callback = None
        self._gone = None  # a face's "has the client left?" probe
        self._probed = 0.0

    def watch(self, gone) -> None:
        """Have the engine ask `gone()` (at most every PROBE_EVERY_S) whether the client has left, so a
        request still queued is dropped before its prefill (Triton's `is_cancelled`: a queued request
        sends nothing through which its departure would show)."""
        self._gone = gone

    def subscribe(self, callback) -> None:
        """Deliver every delta (those already produced first) to `callback(delta)` instead of the
        queue; it runs in the engine's thread."""
        with self._lock:
            while not self._events.empty():
                callback(self._events.get_nowait())
            self._callback = callback

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        if not self._cancel.is_set() and self._gone is not None and time.monotonic() - self._probed > PROBE_EVERY_S:
            self._probed = time.monotonic()
            try:
                if self._gone():
                    self._cancel.set()
            except Exception:  # noqa: BLE001 - a probe that fails means the client cannot be reached
                self._cancel.set()
        return self._cancel.is_set()

    def get(self, timeout: float | None = None) -> Delta:
        return self._events.get(timeout=timeout)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self._events.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def result(self) -> tuple[str, list[int], str]:
        """Block until done: (text, token ids, finish reason)."""
        text, ids, reason = [], [], None
        for d in self:
            text.append(d.text)
            ids += d.token_ids
            reason = d.finish_reason
        return "".join(text), ids, reason

    def _push(self, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        with self._lock:
            if self._callback is not None:
                self._callback(delta)
            else:
                self._events.put(delta)


# With no row decoding: (seconds without a new arrival that end the wait for a burst of requests, the
# longest the first one waits for the rest); 0 = no wait (config.py says why these).
BURST_WAIT = (BURST_WAIT_MS / 1000, BURST_WAIT_CAP * BURST_WAIT_MS / 1000)


class _Active:
    """A request in a cache row: where its prompt is, what it has produced, what is held back."""

    def __init__(self, handle: Handle, row: int, tokenizer: Tokenizer | None, reused: int = 0,
                 speculation: Speculation | None = None):
        self.handle, self.row = handle, row
        self.sampler = Sampler(handle.request.sampling, handle.request.prompt)
        self.prefilled = reused  # prompt tokens already in the cache (a prefix found there counts)
        self.found_prefix = reused > 0
        self.position = 0  # where the next token goes
        self.last: int | None = None  # the token to feed next
        self.decoder = IncrementalDecoder(tokenizer, handle.request.skip_special_tokens) if tokenizer is not None else None
        self.held = ""  # text that might be the start of a stop string
        self.scoring = handle.request.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.carry = None  # log-probabilities after the last prompt chunk scored: its next token's
        wanted = handle.request.draft_tokens
        self.draft_length = None if speculation is None or wanted == 0 else speculation.length(wanted)
        self.output: list[int] = []  # the tokens emitted (the proposer reads the prompt and these)


class Engine:
    """The scheduler. `start()` runs it in a thread; `step()` is one iteration, for tests and callers
    that drive it themselves."""

    def __init__(self, session: Session, tokenizer: Tokenizer | None = None, eos_ids: set[int] | None = None,
                 prefill_chunk: int = 256, max_waiting: int = 1024, prefix_caching: bool = True,
                 decode_stall: float | None = DECODE_STALL, burst_wait: tuple[float, float] = BURST_WAIT,
                 speculation: Speculation | None = None):
        self.session, self.tokenizer = session, tokenizer
        self.speculation = speculation
        self.burst_wait = burst_wait
        self.rows, self.cache_len = session.rows, session.cache_len
        self.eos_ids = set(eos_ids if eos_ids is not None else (tokenizer.eos_ids if tokenizer else ()))
        self.prefill_chunk, self.max_waiting = prefill_chunk, max_waiting
        self.budget = StepBudget(prefill_chunk, decode_stall)
        self.prefix = PrefixCache(session.row_contents) if prefix_caching else None
        self._waiting: deque[Handle] = deque()
        self._active: dict[int, _Active] = {}  # row -> request
        self._free = list(range(self.rows))[::-1]
        self._ids = itertools.count(1)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = self._abort = False
        self.failure: str | None = None  # why the engine stopped serving, once a fault broke it
        self.metrics = EngineMetrics()

    @classmethod
    def from_config(cls, session: Session, tokenizer: Tokenizer | None, config: ServeConfig,
                    eos_ids: set[int] | None = None, speculation: Speculation | None = None) -> Engine:
        """The engine as `config` schedules it (its rows and cache length are the session's)."""
        return cls(session, tokenizer, eos_ids, **config.engine_options(), speculation=speculation)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def healthy(self) -> bool:
        return self.failure is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    # -- requests ---------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise InputError("the prompt is empty")
        least = 0 if request.prompt_logprobs is not None else 1  # a scored prompt needs no new token
        if request.max_tokens < least:
            raise InputError(f"max_tokens must be at least {least}, got {request.max_tokens}")
        if len(request.prompt) + request.max_tokens > self.cache_len:
            raise InputError(f"the prompt ({len(request.prompt)} tokens) and max_tokens ({request.max_tokens}) need "
                             f"{len(request.prompt) + request.max_tokens} positions; a cache row holds {self.cache_len}",
                             hint="shorten the prompt or lower max_tokens")
        vocab = self.session.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise InputError(f"prompt token ids must be in [0, {vocab})")

    def submit(self, request: GenerationRequest) -> Handle:
        self.validate(request)
        with self._wake:
            self.check_capacity()
            handle = Handle(next(self._ids), request)
            self._waiting.append(handle)
            with self.metrics.lock:
                self.metrics.requests_total += 1
            self._wake.notify()
        return handle

    def check_capacity(self) -> None:
        """Raise what `submit` would for a request now, before a face spends work on one."""
        if self.failure is not None:
            raise EngineUnavailable("the engine stopped after an internal fault; the server needs a restart")
        if self._stopping:
            raise EngineUnavailable("the server is shutting down")
        if len(self._waiting) >= self.max_waiting:
            raise EngineFull(f"{len(self._waiting)} requests are already waiting")

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    def idle(self) -> bool:
        return not self._waiting and not self._active

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, then one session step: every decoding row and the next prompt chunks. False when
        there was nothing to do."""
        if self._abort:
            for h in list(self._waiting) + [a.handle for a in self._active.values()]:
                h.cancel()
        for a in [a for a in self._active.values() if a.handle.cancelled]:
            self._finish(a, "cancelled")  # its row is free for the admissions just below
        with self._wake:
            for h in [h for h in self._waiting if h.cancelled]:
                self._waiting.remove(h)
                self._drop_waiting(h, "cancelled")
            while self._waiting and self._free:
                self._admit(self._waiting.popleft())
        if not self._active:
            return False
        decoding = [a for a in self._active.values() if a.last is not None]
        work = self._decode_chunks(decoding)
        prefilling = [a for a in self._active.values() if a.last is None]
        work += self._prompt_chunks(self.budget.prompt_tokens(
            len(decoding), len(prefilling), max((self._steps_left(a) for a in decoding), default=None),
            sum(len(a.handle.request.prompt) - a.prefilled for a in prefilling)))
        self._run(work)
        return True

    def _admit(self, handle: Handle) -> None:
        """Into the free row holding the longest prefix of its prompt (or given a busy row's copy)."""
        reused = 0
        if self.prefix is None or handle.request.prompt_logprobs is not None:  # scored: every position computed
            row = self._free.pop()
        else:
            row, reused, source = self.prefix.place(handle.request.prompt, self._free, list(self._active))
            if source is not None:
                try:
                    self.session.copy_prefix(source, row, reused)
                except NotImplementedError:  # this backend copies no rows: the prompt is computed whole
                    reused = 0
            self._free.remove(row)
        with self.metrics.lock:
            self.metrics.admitted(len(handle.request.prompt), reused)
        self._active[row] = _Active(handle, row, self.tokenizer, reused, self.speculation)

    def _catch_up(self, a: _Active) -> None:
        """Copy the positions of `a`'s prompt that another row has filled since `a` took its row."""
        if self.prefix is None or a.scoring:
            return
        rows = list(self._active) + self._free
        source, n = self.prefix.catch_up(a.row, a.handle.request.prompt, a.prefilled, rows)
        if source is None:
            return
        try:
            self.session.copy_prefix(source, a.row, n)
        except NotImplementedError:
            return
        with self.metrics.lock:
            self.metrics.caught_up(first=not a.found_prefix, tokens=n - a.prefilled)
        a.prefilled, a.found_prefix = n, True

    def _decode_chunks(self, decoding: list[_Active]) -> list[tuple[_Active, Chunk]]:
        """Each decoding row's chunk: its last token, then the proposer's draft where it has one."""
        rows, plans = [], {}
        for a in decoding:
            if a.draft_length is not None:
                # a check of k proposals yields up to k + 1 tokens and writes k + 1 positions
                k = min(a.draft_length.next(), self._steps_left(a) - 1, self.cache_len - a.position - 1)
                if k > 0:
                    plans[a.row] = len(rows)
                    rows.append((a.row, a.handle.request.prompt + a.output, k, a.sampler))
        drafts: list = [None] * len(rows)
        if rows:
            try:
                drafts = self.speculation.propose(rows, self.session.vocab_size)
            except Exception as e:  # noqa: BLE001 - a proposer's fault costs this step its drafts, not the server
                log.error("proposing drafts failed: %s: %s", type(e).__name__, e)
        work = []
        for a in decoding:
            draft = drafts[plans[a.row]] if a.row in plans else None
            if draft is not None and draft.tokens:
                work.append((a, Chunk([a.last, *draft.tokens], a.position, a.row, a.sampler, draft)))
            else:
                work.append((a, Chunk([a.last], a.position, a.row, a.sampler)))
        return work

    def _steps_left(self, a: _Active) -> int:
        """Steps until decoding row `a` ends at the latest (its max_tokens, or the cache's end)."""
        return min(a.handle.request.max_tokens - a.handle.stats.completion_tokens, self.cache_len - a.position)

    def _prompt_chunks(self, budget: int) -> list[tuple[_Active, Chunk]]:
        """The next chunks of the oldest prefilling rows, `budget` prompt tokens in all."""
        out, planned = [], []
        for a in sorted((a for a in self._active.values() if a.prefilled < len(a.handle.request.prompt)),
                        key=lambda x: x.handle.id):
            if budget <= 0:
                break
            self._catch_up(a)
            prompt = a.handle.request.prompt
            end = min(len(prompt), a.prefilled + budget, a.prefilled + self.prefill_chunk)
            if self.prefix is not None:
                if not a.scoring and self.prefix.computed_beside(prompt, a.prefilled, planned):
                    continue  # an older request computes these positions in this step: copied after it
                planned.append((np.asarray(prompt[:end], dtype=np.int64), end))
            budget -= end - a.prefilled
            # Only the last chunk's token is used: sampling an earlier one would advance the
            # request's seeded generator and change what it samples later.
            sampler = a.sampler if end == len(prompt) else None
            out.append((a, Chunk(prompt[a.prefilled:end], a.prefilled, a.row, sampler)))
        return out

    def _run(self, work: list[tuple[_Active, Chunk]]) -> None:
        scored = [(a, c) for a, c in work if a.scoring and a.last is None]
        work = [(a, c) for a, c in work if not (a.scoring and a.last is None)]  # before scoring sets a.last
        for a, chunk in scored:
            self._score(a, chunk)
        if not work:
            return
        rewind = [a.sampler.snapshot() for a, _ in work]
        started = time.perf_counter()
        try:
            yielded = self.session.step_tokens([c for _, c in work])
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            if len(work) > 1:  # rerun one by one (a step's cache writes are idempotent): only the culprit fails
                for (a, _), state in zip(work, rewind, strict=True):
                    a.sampler.restore(state)  # rows the failed step already sampled draw the same again
                for item in work:
                    self._run([item])
                return
            log.error("a step failed for request %d: %s: %s", work[0][0].handle.id, type(e).__name__, e)
            self._finish(work[0][0], "error", "the model step failed for this request (the server log says why)")
            return
        decoding = sum(len(c.ids) for a, c in work if a.last is not None)  # a draft's check runs as decode rows
        self.budget.observe(sum(len(c.ids) for _, c in work) - decoding, decoding, time.perf_counter() - started)
        for (a, chunk), tokens in zip(work, yielded, strict=True):
            try:
                logprobs = a.sampler.take_all_logprobs() if chunk.sampler is not None else []
                if a.last is not None:  # a decode step, or a draft's check: the row advances by what it yields
                    if chunk.draft is not None:
                        self._drafted(a, len(chunk.draft.tokens), len(tokens) - 1)
                    for i, token in enumerate(tokens):
                        a.position += 1
                        self._emit(a, token, logprobs[i] if logprobs else None)
                        if a.row not in self._active or self._active[a.row] is not a:
                            break  # it finished (a stop, its length): the rest is dropped
                    continue
                a.prefilled += len(chunk.ids)
                if a.prefilled == len(a.handle.request.prompt):
                    a.position = a.prefilled
                    self._emit(a, tokens[-1], logprobs[-1] if logprobs else None)
            except Exception as e:  # noqa: BLE001 - this request's output failed: it ends, the others go on
                log.error("request %d failed: %s: %s", a.handle.id, type(e).__name__, e)
                if a.row in self._active:
                    self._finish(a, "error", "the server failed to produce this request's output")

    def _drafted(self, a: _Active, proposed: int, accepted: int) -> None:
        a.draft_length.observe(proposed, accepted)
        with self.metrics.lock:
            self.metrics.drafted(proposed, accepted)

    def _score(self, a: _Active, chunk: Chunk) -> None:
        """A scored request's prompt chunk, alone and with every position's logits: the log-probability
        of each prompt token given those before it."""
        req = a.handle.request
        try:
            out = self.session.prefill(chunk.ids, chunk.slot, chunk.start, logits="all", sampler=chunk.sampler)
            logp = torch.from_numpy(out.logits[0]).log_softmax(-1)  # [T, V]
            k, prompt = req.prompt_logprobs, req.prompt
            if chunk.start == 0:
                a.prompt_logprobs.append(TokenLogprobs(prompt[0], None))
            if a.carry is not None:
                a.prompt_logprobs.append(logprobs_at(a.carry, prompt[chunk.start], k))
            a.prompt_logprobs += [logprobs_at(logp[j], prompt[chunk.start + j + 1], k) for j in range(len(chunk.ids) - 1)]
            a.carry = logp[-1]
            a.prefilled += len(chunk.ids)
            if a.prefilled < len(prompt):
                return
            a.position, a.carry = a.prefilled, None
            a.handle._push(Delta("", [], prompt_logprobs=a.prompt_logprobs))
            if req.max_tokens == 0:
                self._finish(a, "length")
            else:
                self._emit(a, out.tokens[0], a.sampler.take_logprobs() if chunk.sampler is not None else None)
        except Exception as e:  # noqa: BLE001 - this request's scoring failed: it ends, the others go on
            log.error("scoring request %d failed: %s: %s", a.handle.id, type(e).__name__, e)
            if a.row in self._active:
                self._finish(a, "error", "the model step failed for this request (the server log says why)")

    def _emit(self, a: _Active, token: int, logprobs: TokenLogprobs | None = None) -> None:
        req, st = a.handle.request, a.handle.stats
        now = time.perf_counter()
        if (token in self.eos_ids and not req.ignore_eos) or token in req.stop_token_ids:
            self._finish(a, "stop")
            return
        st.completion_tokens += 1
        st.token(now)
        with self.metrics.lock:
            self.metrics.tokens_generated += 1
        a.last = token
        a.output.append(token)
        text = a.held + (a.decoder.push(token) if a.decoder else "")
        lps = [logprobs] if logprobs is not None else []
        cut = _first_stop(text, req.stop)
        if cut is not None:
            a.handle._push(Delta(text[:cut], [token], logprobs=lps))
            self._finish(a, "stop")
            return
        keep = _stop_prefix_len(text, req.stop)
        a.held = text[len(text) - keep:] if keep else ""
        a.handle._push(Delta(text[:len(text) - keep], [token], logprobs=lps))
        if st.completion_tokens >= req.max_tokens or a.position >= self.cache_len:
            self._finish(a, "length")

    def _finish(self, a: _Active, reason: str, error: str | None = None) -> None:
        tail = a.held + (a.decoder.flush() if a.decoder and reason == "length" else "")
        if reason == "length" and a.handle.request.stop:
            cut = _first_stop(tail, a.handle.request.stop)
            tail = tail if cut is None else tail[:cut]
        self._active.pop(a.row, None)
        with self._wake:
            self._free.append(a.row)
        st = a.handle.stats
        self.metrics.finished(reason, st.ttft_s, st.inter_token)
        a.handle._push(Delta(tail if reason == "length" else "", [], reason, error))

    def _drop_waiting(self, handle: Handle, reason: str, error: str | None = None) -> None:
        self.metrics.finished(reason, None, Histogram())
        handle._push(Delta("", [], reason, error))

    # -- a thread of its own ----------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            release_openmp_pool()  # the engine's thread runs every step from now on
            self._thread = threading.Thread(target=self._loop, name="linnet-engine", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._active and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._waiting and not self._active:
                    return
            try:
                self._await_burst()
                self.step()
            except Exception as e:  # noqa: BLE001 - the scheduler itself broke: nothing it holds can go on
                self._fail(e)
                return

    def _await_burst(self) -> None:
        """With no row decoding, wait while requests keep arriving (a client's next requests after a
        batch ended come within milliseconds): admitted together, their prompts share one step and
        they then decode in step, instead of each new one stalling those already decoding."""
        if self.burst_wait[0] <= 0 or any(a.last is not None for a in self._active.values()):
            return
        deadline = time.monotonic() + self.burst_wait[1]
        with self._wake:
            seen = len(self._waiting)
            while (seen or self._active) and seen < len(self._free) and not self._stopping and not self._abort:
                quiet = min(self.burst_wait[0], deadline - time.monotonic())
                if quiet <= 0:
                    return
                self._wake.wait(quiet)
                if len(self._waiting) == seen:  # nothing more came: go
                    return
                seen = len(self._waiting)

    def _fail(self, e: Exception) -> None:
        """End every request in flight or waiting with "error" and refuse new ones (unhealthy)."""
        log.exception("the engine stopped: %s: %s", type(e).__name__, e)
        with self._wake:
            self.failure = f"{type(e).__name__}: {e}"
            waiting, self._waiting = list(self._waiting), deque()
        message = "the engine failed (the server log says why)"
        for a in list(self._active.values()):
            try:
                self._finish(a, "error", message)
            except Exception:  # noqa: BLE001 - its output is what broke: end it without the tail
                if self._active.pop(a.row, None) is not None:
                    self._free.append(a.row)
                a.handle._push(Delta("", [], "error", message))
        for h in waiting:
            self._drop_waiting(h, "error", message)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish for up to `timeout`, cancel the rest."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        deadline = time.monotonic() + timeout
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._wake:
            self._abort = True  # the loop cancels whatever is left (it alone touches the rows)
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, deadline - time.monotonic() + 5))
            self._thread = None


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
