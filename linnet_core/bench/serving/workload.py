"""What the serving bench sends: the requests' shape (Workload), their prompts, and their pacing."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from ...errors import CheckpointError, InputError
from ...tokenizer import Tokenizer


# what the bench's own requests set: --request-fields may not change them
OWN_FIELDS = {"model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos", "min_tokens", "temperature"}


@dataclass(frozen=True)
class Workload:
    requests: int = 256
    prompt_min: int = 128
    prompt_max: int = 512
    new_tokens: int = 128
    concurrency: int = 64
    rate: float | None = None  # requests/s, Poisson arrivals; None = all at once (bounded by concurrency)
    seed: int = 0
    shared_prefix: int = 0  # tokens of one system prompt before every request's own
    turns: int = 1  # requests per chat; a chat's turns go one after another
    request_fields: str = ""  # a JSON object of fields every OpenAI-API request carries (a response_format, ...)

    def __post_init__(self):
        if self.requests < 1 or self.concurrency < 1 or self.new_tokens < 1:
            raise InputError("--requests, --concurrency and --new-tokens must be at least 1")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise InputError(f"bad prompt range {self.prompt_min}-{self.prompt_max}")
        if self.rate is not None and self.rate <= 0:
            raise InputError(f"--rate must be positive, got {self.rate}")
        if self.shared_prefix < 0 or self.turns < 1:
            raise InputError("--shared-prefix must be at least 0 and --turns at least 1")
        if self.requests % self.turns:
            raise InputError(f"--requests ({self.requests}) must be a multiple of --turns ({self.turns})")
        fields = self.fields  # read once here, so a bad value is refused before anything runs
        taken = sorted(set(fields) & OWN_FIELDS)
        if taken:
            raise InputError(f"--request-fields may not set {', '.join(taken)}: the bench sets those itself")

    @property
    def fields(self) -> dict:
        if not self.request_fields:
            return {}
        try:
            fields = json.loads(self.request_fields)
        except ValueError:
            raise InputError("--request-fields must be a JSON object, e.g. '{\"response_format\": {...}}'") from None
        if not isinstance(fields, dict):
            raise InputError("--request-fields must be a JSON object")
        return fields

    @property
    def longest_prompt(self) -> int:
        return self.shared_prefix + self.turns * self.prompt_max + (self.turns - 1) * self.new_tokens

    def compose(self, pieces: list[list[int]], vocab: int) -> list[list[int]]:
        """The requests' prompts from their own parts: the shared system prompt before each, and a
        chat's earlier turns (an answer of `new_tokens` after each) before its later ones."""
        rng = np.random.default_rng(self.seed + 7)
        system = rng.integers(0, vocab, self.shared_prefix).tolist()
        prompts = []
        for i, piece in enumerate(pieces):
            if i % self.turns == 0:
                prompts.append(system + piece)
            else:
                prompts.append(prompts[-1] + rng.integers(0, vocab, self.new_tokens).tolist() + piece)
        return prompts

    @property
    def steady(self) -> bool:
        return self.requests >= 5 * self.concurrency

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        lengths = rng.integers(self.prompt_min, self.prompt_max + 1, self.requests)
        return [rng.integers(0, vocab, int(n)).tolist() for n in lengths]

    def describe(self) -> str:
        arrival = f"Poisson at {self.rate:g} req/s" if self.rate else "all at once"
        shape = f" after a {self.shared_prefix}-token shared system prompt" if self.shared_prefix else ""
        if self.turns > 1:
            shape += f", in chats of {self.turns} turns (each turn's prompt holds the earlier ones)"
        return (f"{self.requests} requests of {self.prompt_min}-{self.prompt_max} prompt tokens{shape} and "
                f"{self.new_tokens} new, at most {self.concurrency} in flight, {arrival}")


@dataclass
class RequestResult:
    ok: bool
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None
    retried: bool = False  # sent again once: the first connection closed before any answer

    def failed(self, error: str, keep_tokens: bool = False) -> "RequestResult":
        """This request, ended now with `error`; the tokens it had timed count only where `keep_tokens`."""
        self.ok, self.end, self.error = False, time.perf_counter(), error
        if not keep_tokens:
            self.token_times = []
        return self

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


async def paced(workload: Workload, prompts: list, one) -> tuple[list[RequestResult], float]:
    """Run `one(prompt)` for every prompt: at most `concurrency` at once, arriving as the workload says
    (a chat arrives as a whole, and its turns go one after another)."""
    sem = asyncio.Semaphore(workload.concurrency)
    rng = np.random.default_rng(workload.seed + 1)
    t0 = time.perf_counter()
    chats = [prompts[i:i + workload.turns] for i in range(0, len(prompts), workload.turns)]

    async def guarded(chat: list, delay: float) -> list[RequestResult]:
        await asyncio.sleep(delay)
        out = []
        for prompt in chat:
            async with sem:
                out.append(await one(prompt))
        return out

    delays = np.cumsum(rng.exponential(1 / workload.rate, len(chats))) if workload.rate else [0.0] * len(chats)
    results = await asyncio.gather(*(guarded(c, float(d)) for c, d in zip(chats, delays, strict=True)))
    return [r for chat in results for r in chat], time.perf_counter() - t0


def round_trippable(workload: Workload, model) -> list[list[int]]:
    """The workload's prompts. With a tokenizer they are drawn from its vocabulary and made stable
    under decode-then-encode, so a target that takes text (Triton) gets the same prompts."""
    try:
        tok = Tokenizer(model.path)
    except CheckpointError:
        return workload.compose(workload.prompts(model.spec.vocab_size), model.spec.vocab_size)
    vocab = min(tok.vocab_size, model.spec.vocab_size)
    prompts = []
    for p in workload.prompts(vocab):
        for _ in range(3):  # a couple of rounds settle it; lengths stay in the range
            again = tok.encode(tok.decode(p), add_special_tokens=False)
            p = (again + p)[:len(p)] if len(again) < len(p) else again[:len(p)]
        prompts.append(p)
    return workload.compose(prompts, vocab)
