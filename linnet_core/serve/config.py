"""One serving configuration, validated once, whichever face it comes from: `linnet serve`'s options,
the serving bench, or the `linnet_*` parameters of a Triton model's config.pbtxt. Its defaults are the
only ones; `Engine.from_config` takes it, and a served process started for the bench gets it back as
command-line options."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import InputError
from ..hub import DEFAULT_MODEL_NAME

DECODE_STALL = 2.0  # a step with prompt work takes at most this many decode-only steps' time (measured)
# With no row decoding: milliseconds without a new arrival that end the wait for a burst of requests;
# the first one waits 2.5 times that at most. A client's next requests after a batch ended came within
# 5-16 ms of each other over HTTP on 2 cores.
BURST_WAIT_MS = 20.0
BURST_WAIT_CAP = 2.5
TRITON_PREFIX = "linnet_"


@dataclass(frozen=True)
class ServeConfig:
    """What to load and how the engine schedules it (the HTTP face's own limits stay with `linnet serve`)."""

    model: str | None = None  # a checkpoint folder, GGUF file, repo id or short name; None: the embedded model
    backend: str = "torch"
    dtype: str = "auto"
    rows: int = 8  # KV-cache rows: requests decoded together
    cache_len: int | None = None  # None: the model's default
    prefill_chunk: int = 256  # prompt tokens per step, at most
    max_waiting: int = 1024  # queued requests before the engine refuses more
    decode_stall: float = DECODE_STALL  # 0: no bound but prefill_chunk
    burst_wait_ms: float = BURST_WAIT_MS  # 0: admit each request at once
    prefix_caching: bool = True
    # speculative decoding (linnet_core.speculation.SpeculationOptions): none unless one is named
    speculate: str | None = None  # "ngram" or "draft"
    draft: str | None = None  # the draft model; implies speculate = "draft"
    draft_tokens: int = 4  # the most proposed per step (a request's `draft_tokens` may ask for fewer)
    adaptive_draft: bool = True
    draft_backend: str | None = None  # None: the target's
    draft_dtype: str = "auto"
    spelling: str = field(default="cli", compare=False)  # how errors name a field: "cli" (--rows) or "triton"

    def __post_init__(self):
        for name in ("rows", "prefill_chunk", "max_waiting"):
            if _not_int(getattr(self, name)) or getattr(self, name) < 1:
                raise InputError(f"{self.option(name)} must be an integer of at least 1, got {getattr(self, name)!r}")
        if self.cache_len is not None and (_not_int(self.cache_len) or self.cache_len < 1):
            raise InputError(f"{self.option('cache_len')} must be an integer of at least 1, got {self.cache_len!r}")
        if not isinstance(self.decode_stall, int | float) or not (self.decode_stall == 0 or 1 <= self.decode_stall < math.inf):
            raise InputError(f"{self.option('decode_stall')} is 0 (off) or at least 1, got {self.decode_stall!r}")
        if not isinstance(self.burst_wait_ms, int | float) or not 0 <= self.burst_wait_ms <= 60_000:
            raise InputError(f"{self.option('burst_wait_ms')} must be 0 to 60000 milliseconds, "
                             f"got {self.burst_wait_ms!r}")
        for name in ("prefix_caching", "adaptive_draft"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{self.option(name)} must be true or false")
        if _not_int(self.draft_tokens) or not 1 <= self.draft_tokens <= 16:
            raise InputError(f"{self.option('draft_tokens')} must be an integer from 1 to 16, got {self.draft_tokens!r}")

    def option(self, name: str) -> str:
        """The field as the face that configured it spells it."""
        if self.spelling == "triton":
            return f"parameter '{TRITON_PREFIX}{name}'"
        return "--" + {"burst_wait_ms": "burst-wait"}.get(name, name.replace("_", "-"))

    def engine_options(self) -> dict[str, Any]:
        """Engine's keyword arguments."""
        seconds = self.burst_wait_ms / 1000
        return {"prefill_chunk": self.prefill_chunk, "max_waiting": self.max_waiting,
                "prefix_caching": self.prefix_caching, "decode_stall": self.decode_stall or None,
                "burst_wait": (seconds, BURST_WAIT_CAP * seconds)}

    def serve_args(self) -> list[str]:
        """`linnet serve`'s options for this configuration (the model is the positional argument)."""
        args = ["--backend", self.backend, "--dtype", self.dtype, "--rows", str(self.rows),
                "--prefill-chunk", str(self.prefill_chunk), "--max-waiting", str(self.max_waiting),
                "--decode-stall", f"{self.decode_stall:g}", "--burst-wait", f"{self.burst_wait_ms:g}",
                "--prefix-caching" if self.prefix_caching else "--no-prefix-caching"]
        args += ["--cache-len", str(self.cache_len)] if self.cache_len else []
        args += ["--speculate", self.speculate] if self.speculate else []
        args += ["--draft", self.draft, "--draft-dtype", self.draft_dtype] if self.draft else []
        args += ["--draft-backend", self.draft_backend] if self.draft_backend else []
        if self.speculate or self.draft:
            args += ["--draft-tokens", str(self.draft_tokens),
                     "--adaptive-draft" if self.adaptive_draft else "--fixed-draft"]
        return args

    def to_parameters(self) -> dict[str, str]:
        """Every field as a Triton model parameter (`linnet_<field>`: string values, as config.pbtxt holds them)."""
        out = {}
        for name, value in asdict(self).items():
            if name == "spelling":
                continue
            text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            out[TRITON_PREFIX + name] = text
        return out

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> ServeConfig:
        """The configuration a Triton model's `linnet_*` parameters hold; others (EXECUTION_ENV_PATH) are Triton's."""
        known = {f.name: f for f in fields(cls) if f.name != "spelling"}
        values: dict[str, Any] = {}
        for key, text in params.items():
            if not key.startswith(TRITON_PREFIX):
                continue
            name = key[len(TRITON_PREFIX):]
            if name not in known:
                raise InputError(f"unknown parameter '{key}' (Linnet's are: "
                                 f"{', '.join(TRITON_PREFIX + n for n in known)})")
            default = getattr(cls, name)
            value = _parse(key, text, type(default) if default is not None else int if name == "cache_len" else str)
            if value is not None:  # empty (or a cache length of 0): the default
                values[name] = value
        return cls(**values, spelling="triton")


def served_name(model: str | None) -> str:
    """The name the API reports for `model` unless `--name` says otherwise: its last path part."""
    return (model or DEFAULT_MODEL_NAME).rstrip("/").split("/")[-1]


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _parse(key: str, text: str, kind: type) -> Any:
    text = str(text).strip()
    if text == "" or (key.endswith("cache_len") and text == "0"):
        return None
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        return kind(text)
    except ValueError:
        what = {int: "an integer", float: "a number", bool: "true or false"}.get(kind, "text")
        raise InputError(f"parameter '{key}' must be {what}, got {text!r}") from None
