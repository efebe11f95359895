"""A bench result as text: the numbers each metric shows, a Rich table and Markdown."""

from __future__ import annotations

from dataclasses import dataclass

from .machine import describe, kernels_note
from .run import BenchResult
from .subjects import BASELINE


@dataclass(frozen=True)
class Metric:
    key: str  # in BenchResult.rows()
    title: str
    unit: str
    higher_is_better: bool

    def fmt(self, value: float | None) -> str:
        return "–" if value is None else f"{number(value)} {self.unit}".strip()


METRICS = (
    Metric("ttft_ms", "Time to first token", "ms", False),
    Metric("decode_tok_s", "Decode speed", "tok/s", True),
    Metric("load_s", "Load time", "s", False),
    Metric("peak_memory_gib", "Peak memory", "GiB", False),
    Metric("distance", "Distance from reference", "", False),
)


def number(v: float) -> str:
    """Three significant figures, thousands separated, as the pages print them."""
    if v == 0:
        return "0"
    if abs(v) < 0.01:
        return f"{v:.2e}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    digits = max(0, 2 - int(f"{abs(v):e}".split("e")[1]))
    return f"{v:.{digits}f}"


def rows(result: BenchResult) -> list[dict]:
    out = result.rows()
    for r in out:
        r["peak_memory_gib"] = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else None
    return out


def best(rows_: list[dict], metric: Metric) -> dict | None:
    """The winning side for a metric (the reference cannot win on its distance from itself)."""
    measured = [r for r in rows_ if r.get(metric.key) is not None and r["status"] == "ok"
                and not (metric.key == "distance" and r["key"] == BASELINE)]
    if not measured:
        return None
    return (max if metric.higher_is_better else min)(measured, key=lambda r: r[metric.key])


def ratio(r: dict) -> str:
    return "–" if r["decode_speedup"] is None else f"{r['decode_speedup']:.2f}×"


def roofline(r: dict) -> str:
    if r["roofline"] is None:
        return "–"
    return f"{r['roofline']:.0%}" + ("*" if r.get("roofline_under_read") else "")


def load_note(r: dict) -> str:
    if r["load_s"] is None:
        return "–"
    if r["linnet"]:
        return f"{number(r['load_s'])} s ({'cached' if r['artifact_cached'] else 'just compiled'})"
    return f"{number(r['load_s'])} s"


def status_text(r: dict) -> str:
    if r["status"] == "missing":
        return f"missing: {r['reason']}"
    if r["status"] == "failed":
        return f"failed: {r['reason']}"
    return r.get("reason") or r["note"]


def header(result: BenchResult) -> str:
    where = result.env.get("gpu") or f"{result.env['cpu']} ({result.env['threads']} threads{kernels_note(result.env)})"
    stopped = "INTERRUPTED" if result.interrupted else "TIME LIMIT" if result.time_limited else None
    done = f" · {stopped} after {result.completed_runs} of {result.method.runs} runs" if stopped else ""
    return f"{result.model} · {result.dtype} · {where} · {result.method.describe()}{done}"


def roofline_line(result: BenchResult) -> str:
    line = (f"Roofline: memory bandwidth {result.bandwidth_bytes_s / 1e9:.1f} GB/s (measured); a decode step reads "
            f"{result.bytes_per_step / 1e6:,.0f} MB (weights and KV cache), so the ceiling is "
            f"{result.bandwidth_bytes_s / result.bytes_per_step * result.method.batch:,.1f} tok/s.")
    if any(r.get("roofline_under_read") for r in result.rows()):
        line += (" * Above 100%: the bandwidth probe read less than that side moved (the machine was busier "
                 "while it ran), so the true ceiling is higher than printed.")
    nominal = result.env.get("gpu_nominal_bandwidth_bytes_s")
    if nominal:
        line += (f" On the datasheet's {nominal / 1e12:.2f} TB/s it is "
                 f"{nominal / result.bytes_per_step * result.method.batch:,.1f} tok/s.")
    return line


def speculative_lines(result: BenchResult) -> list[str]:
    """Per side that speculated: its decode against its own plain decode in the same runs."""
    out = []
    for r in result.rows():
        sp = r.get("speculative")
        if not sp:
            continue
        line = (f"{r['label']}: speculative {number(sp['decode_tok_s'])} tok/s against plain "
                f"{number(sp['plain_decode_tok_s'])} ({sp['speedup']:.2f}×), acceptance {sp['acceptance']:.2f}")
        if sp["tokens_per_step"] is not None:
            line += f", {sp['tokens_per_step']:.2f} tokens per target step"
        if sp["same_output"] is not None:
            line += ", the plain run's tokens" if sp["same_output"] else ", OTHER TOKENS than the plain run"
        out.append(line)
    return out


def rich_table(result: BenchResult):
    """The terminal's table: figures per side; why a side is missing or failed, under it."""
    from rich.markup import escape
    from rich.table import Table

    rs = rows(result)
    absent = [f"{r['label']}: {status_text(r)}" for r in rs if r["status"] != "ok"]
    caption = "\n".join([roofline_line(result)] + speculative_lines(result) + absent)
    table = Table(title=escape(header(result)), title_justify="left", caption=escape(caption),
                  caption_justify="left")
    table.add_column("side", no_wrap=True)
    for name in ("TTFT", "decode", "vs transformers", "roofline", "load", "peak memory", "distance"):
        table.add_column(name, justify="right", no_wrap=True)
    bests = {m.key: best(rs, m) for m in METRICS}
    for r in rs:
        def cell(key: str, r=r) -> str:
            text = METRICS_BY_KEY[key].fmt(r.get(key))
            return f"[bold red]{text}[/]" if bests[key] is r else text

        if r["status"] != "ok":
            table.add_row(escape(r["label"]), r["status"], *[""] * 6, style="dim")
            continue
        table.add_row(escape(r["label"]), cell("ttft_ms"), cell("decode_tok_s"), ratio(r), roofline(r),
                      load_note(r), cell("peak_memory_gib"), cell("distance"), style="bold" if r["linnet"] else "")
    return table


METRICS_BY_KEY = {m.key: m for m in METRICS}


def markdown(result: BenchResult) -> str:
    rs = rows(result)
    lines = [f"**{header(result)}**", "",
             "| side | TTFT | decode | vs transformers | roofline | load | peak memory | distance | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    bests = {m.key: best(rs, m) for m in METRICS}
    for r in rs:
        def cell(key: str, r=r) -> str:
            text = METRICS_BY_KEY[key].fmt(r.get(key))
            return f"**{text}**" if bests[key] is r else text

        lines.append(f"| {r['label']} | {cell('ttft_ms')} | {cell('decode_tok_s')} | {ratio(r)} | {roofline(r)} | "
                     f"{load_note(r)} | {cell('peak_memory_gib')} | {cell('distance')} | "
                     f"{status_text(r).replace('|', '/')} |")
    lines += ["", roofline_line(result), *(["", *speculative_lines(result)] if speculative_lines(result) else []),
              "", describe(result.env)]
    return "\n".join(lines) + "\n"
