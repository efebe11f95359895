"""The serving bench as people read it: a table (Rich or Markdown), its header, and the notes that say
how each target was run and why requests failed."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..machine import describe
from .result import ServingResult, TargetRow

COLUMNS = (("output tok/s", "output_tok_s", "{:,.1f}"), ("speed-up", "speedup", "{:.2f}×"),
           ("req/s", "request_s", "{:.2f}"), ("TTFT med", "ttft_ms_median", "{:,.0f} ms"),
           ("TTFT p99", "ttft_ms_p99", "{:,.0f} ms"), ("TPOT med", "tpot_ms_median", "{:,.1f} ms"),
           ("ITL med", "itl_ms_median", "{:,.1f} ms"), ("ITL p99", "itl_ms_p99", "{:,.1f} ms"),
           ("e2e med", "e2e_ms_median", "{:,.0f} ms"), ("e2e p99", "e2e_ms_p99", "{:,.0f} ms"),
           ("failed", "failed", "{}"), ("peak memory", "peak_memory_bytes", "{}"))


def cell(row: TargetRow, key: str, fmt: str) -> str:
    v = getattr(row, key)
    if v is None:
        return "–"
    if key == "peak_memory_bytes":
        return f"{v / 2**30:.2f} GiB"
    return fmt.format(v)


def header(result: ServingResult) -> str:
    steady = "" if result.steady_state else " (fewer than 5× the concurrency: not a steady state)"
    rounds = f" · median of {result.rounds} interleaved rounds" if result.rounds > 1 else ""
    stall = result.config.decode_stall
    budget = f" · decode stall ≤ {stall:g}×" if stall else " · prompt chunks unbounded by decode"
    return (f"{result.model} · {result.config.backend}, {result.config.rows} rows{budget} · "
            f"{result.workload.describe()}{steady}{rounds}")


def markdown(result: ServingResult) -> str:
    lines = [f"**{header(result)}**", "", describe(result.environment), "", "| target | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for r in result.targets:
        lines.append(f"| {r.label} | " + " | ".join(cell(r, k, f) for _, k, f in COLUMNS) + " |")
    if result.rounds > 1:
        lines += ["", "Output tok/s in each round: " + "; ".join(
            f"{r.label} " + ", ".join(f"{x:,.1f}" for x in r.rounds_output_tok_s) for r in result.targets)]
    said = notes(result.targets)
    lines += [""] + [f"- {n}" for n in said] if said else []
    return "\n".join(lines) + "\n"


def notes(rows: list[TargetRow]) -> list[str]:
    """What each target's figures mean (how it was run), and why requests failed."""
    out = []
    for r in rows:
        if r.note:
            out.append(f"{r.label}: {r.note}")
        if r.failed:
            out.append(f"{r.label}: {r.failed} of {r.requests} requests failed: " + "; ".join(r.errors))
        if r.retried:
            out.append(f"{r.label}: {r.retried} requests sent again once, their first connection closed by "
                       "the server before any answer (their time counts)")
    return out


def rich_table(result: ServingResult) -> Table:
    table = Table(title=escape(header(result)), title_justify="left", caption=escape(describe(result.environment)),
                  caption_justify="left")
    table.add_column("target", no_wrap=True)
    for name, _, _ in COLUMNS:
        table.add_column(name, justify="right", no_wrap=True)
    for r in result.targets:
        table.add_row(escape(r.label), *(cell(r, k, f) for _, k, f in COLUMNS))
    return table
