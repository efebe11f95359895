"""The serving bench's typed results: one row per target (its median round), the whole run, and
their JSON (the same document `--save` has always written)."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from ...serve.config import ServeConfig
from .workload import RequestResult, Workload


@dataclass
class TargetRow:
    target: str
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tok_s: float | None
    request_s: float | None
    peak_memory_bytes: int | None
    note: str
    retried: int
    errors: list[str]
    ttft_ms_median: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_median: float | None = None
    tpot_ms_p99: float | None = None
    itl_ms_median: float | None = None
    itl_ms_p99: float | None = None
    e2e_ms_median: float | None = None
    e2e_ms_p99: float | None = None
    label: str = ""  # how tables name it
    speedup: float | None = None  # against the sequential baseline of the same run
    rounds_output_tok_s: list[float | None] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(name: str, results: list[RequestResult], wall: float, workload: Workload,
              peak_memory: int | None = None, note: str = "") -> TargetRow:
    ok = [r for r in results if r.ok]
    tokens = sum(len(r.token_times) for r in ok)
    row = TargetRow(name, len(results), len(results) - len(ok), tokens, wall, tokens / wall if wall else None,
                    len(ok) / wall if wall else None, peak_memory, note, sum(r.retried for r in results),
                    sorted({r.error for r in results if r.error})[:5])
    latencies = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
                 "itl": [b - a for r in ok for a, b in itertools.pairwise(r.token_times)],
                 "e2e": [r.end - r.start for r in ok]}
    for key, values in latencies.items():
        if values:
            setattr(row, f"{key}_ms_median", _pct(values, 50) * 1000)
            setattr(row, f"{key}_ms_p99", _pct(values, 99) * 1000)
    return row


def with_speedups(rows: list[TargetRow], baseline: str = "sequential") -> list[TargetRow]:
    base = next((r for r in rows if r.target == baseline), None)
    for r in rows:
        r.speedup = r.output_tok_s / base.output_tok_s if base and base.output_tok_s and r.output_tok_s else None
    return rows


@dataclass
class ServingResult:
    model: str
    config: ServeConfig  # the engine's settings every Linnet target ran with
    workload: Workload
    environment: dict
    targets: list[TargetRow]
    rounds: int = 1

    @property
    def steady_state(self) -> bool:
        return self.workload.steady

    def to_json(self) -> dict:
        return {"model": self.model, "backend": self.config.backend, "rows": self.config.rows,
                "workload": asdict(self.workload), "steady_state": self.steady_state, "environment": self.environment,
                "targets": [t.to_json() for t in self.targets], "rounds": self.rounds,
                "decode_stall": self.config.decode_stall or None,
                "engine": {k: v for k, v in asdict(self.config).items() if k not in ("model", "spelling")}}
