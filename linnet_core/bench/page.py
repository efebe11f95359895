"""The bench as one self-contained HTML page: headline ratios, a bar chart per metric, every number.

No network and no scripts: styles inline, charts as inline SVG (grouped by stack, the best bar
red, values printed on the bars), so the file can be mailed, archived or served as is.
"""

from __future__ import annotations

from html import escape

from .machine import describe
from .report import (
    METRICS,
    Metric,
    best,
    header,
    load_note,
    number,
    ratio,
    roofline,
    roofline_line,
    rows,
    speculative_lines,
    status_text,
)
from .run import BenchResult
from .serving import report as serving_report
from .serving.result import ServingResult

BAR_H, GAP, LABEL_W, CHART_W, VALUE_W = 22, 6, 250, 560, 120
STYLE = """
body{font:15px/1.5 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#1d2330;max-width:1100px;margin:2rem auto;
padding:0 1.5rem;background:#fbfbfd}
h1{font-size:1.9rem;margin:.2rem 0}h2{font-size:1.25rem;margin:2.2rem 0 .3rem}
.sub{color:#5b6475}.env{color:#5b6475;font-size:.85rem}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:.8rem;margin-top:1rem}
.card{background:#fff;border:1px solid #e3e6ee;border-radius:10px;padding:.8rem 1rem}
.card b{font-size:1.35rem;color:#c0262d}.card .who{font-size:.88rem;color:#5b6475}
svg{background:#fff;border:1px solid #e3e6ee;border-radius:10px;margin:.4rem 0}
svg text{font:13px system-ui,sans-serif;fill:#1d2330}svg .group{font-weight:600;fill:#5b6475}
table{border-collapse:collapse;width:100%;background:#fff;font-size:.86rem}
th,td{border-bottom:1px solid #e8eaf0;padding:.35rem .5rem;text-align:right;vertical-align:top}
th{background:#f2f4f8}td:first-child,th:first-child,td:last-child,th:last-child{text-align:left}
tr.linnet td:first-child{font-weight:600}tr.off td{color:#8a91a0}.best{color:#c0262d;font-weight:700}
.note{color:#5b6475;font-size:.85rem}
"""


def chart(rs: list[dict], metric: Metric) -> str:
    """Horizontal bars, one per measured side, grouped by stack; a missing side gets no bar."""
    measured = [r for r in rs if r.get(metric.key) is not None and r["status"] == "ok"]
    if not measured:
        return f'<p class="note">No side measured {escape(metric.title.lower())}.</p>'
    top = max(r[metric.key] for r in measured) or 1.0
    winner = best(rs, metric)
    y, parts, stack = 8, [], None
    for r in measured:
        if r["stack"] != stack:
            stack = r["stack"]
            y += 6
            parts.append(f'<text class="group" x="8" y="{y + 12}">{escape(stack)}</text>')
            y += BAR_H
        w = max(1.0, CHART_W * r[metric.key] / top)
        color = "#c0262d" if r is winner else ("#3b6fd4" if r["linnet"] else "#9aa3b5")
        parts.append(f'<text x="{LABEL_W - 8}" y="{y + 15}" text-anchor="end">{escape(r["label"])}</text>'
                     f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" rx="3" fill="{color}">'
                     f'<title>{escape(r["label"])}: {escape(metric.fmt(r[metric.key]))}</title></rect>'
                     f'<text x="{LABEL_W + w + 6:.1f}" y="{y + 15}">{escape(metric.fmt(r[metric.key]))}</text>')
        y += BAR_H + GAP
    height = y + 8
    width = LABEL_W + CHART_W + VALUE_W
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" aria-label="{escape(metric.title)}">{"".join(parts)}</svg>')


def headline_cards(rs: list[dict]) -> str:
    """For each stack: its fastest Linnet side against the fastest other side of that stack (or the reference)."""
    ok = [r for r in rs if r["status"] == "ok" and r["decode_tok_s"]]
    cards = []
    for stack in dict.fromkeys(r["stack"] for r in ok):
        ours = [r for r in ok if r["stack"] == stack and r["linnet"]]
        theirs = [r for r in ok if r["stack"] == stack and not r["linnet"]] or \
            [r for r in ok if r["key"] == "transformers"]
        if not ours or not theirs:
            continue
        a = max(ours, key=lambda r: r["decode_tok_s"])
        b = max(theirs, key=lambda r: r["decode_tok_s"])
        cards.append(_card(a, b, f"in {stack}"))
    engines = [r for r in ok if r["stack"] == "LLM engines"]
    ours = [r for r in ok if r["linnet"]]
    if engines and ours:  # the engines people run, against Linnet's fastest side on any stack
        cards.append(_card(max(ours, key=lambda r: r["decode_tok_s"]),
                           max(engines, key=lambda r: r["decode_tok_s"]), "one request"))
    return f'<div class="cards">{"".join(cards)}</div>' if cards else ""


def _card(a: dict, b: dict, where: str) -> str:
    """Linnet side `a` against side `b` on decode speed: the ratio in words, then both figures."""
    x = a["decode_tok_s"] / b["decode_tok_s"]
    verdict = f"{x:.2f}× faster" if x >= 1.05 else (f"{x:.2f}× the speed" if x > 0.95 else f"{1 / x:.2f}× slower")
    return (f'<div class="card"><div>vs {escape(b["label"])}, {escape(where)}</div><b>{verdict}</b> decode speed'
            f'<div class="who">{escape(a["label"])} {number(a["decode_tok_s"])} tok/s · {escape(b["label"])} '
            f'{number(b["decode_tok_s"])} tok/s</div></div>')


def every_number(rs: list[dict]) -> str:
    bests = {m.key: best(rs, m) for m in METRICS}
    head = ("<tr><th>side</th><th>TTFT</th><th>decode</th><th>vs transformers</th><th>roofline</th><th>load</th>"
            "<th>peak memory</th><th>distance</th><th>runs</th><th>notes</th></tr>")
    body = []
    for r in rs:
        def cell(key: str, r=r) -> str:
            text = escape(next(m for m in METRICS if m.key == key).fmt(r.get(key)))
            return f'<td class="best">{text}</td>' if bests[key] is r else f"<td>{text}</td>"

        cls = " ".join(c for c in ("linnet" if r["linnet"] else "", "off" if r["status"] != "ok" else "") if c)
        body.append(f'<tr class="{cls}"><td>{escape(r["label"])}</td>{cell("ttft_ms")}{cell("decode_tok_s")}'
                    f'<td>{ratio(r)}</td><td>{roofline(r)}</td><td>{escape(load_note(r))}</td>'
                    f'{cell("peak_memory_gib")}{cell("distance")}<td>{len(r["samples"])}</td>'
                    f'<td>{escape(status_text(r))}</td></tr>')
    return f"<table>{head}{''.join(body)}</table>"


def render(result: BenchResult, command: str | None = None) -> str:
    rs = rows(result)
    sections = []
    for metric in METRICS:
        better = "higher is better" if metric.higher_is_better else "lower is better"
        unit = f"{metric.unit}, " if metric.unit else ""
        sections.append(f'<h2>{escape(metric.title)}</h2><p class="sub">{escape(unit)}{better}; the best bar is '
                        f'red, Linnet blue.</p>{chart(rs, metric)}')
    reproduce = f'<p class="note">Reproduce: <code>{escape(command)}</code></p>' if command else ""
    speculative = "".join(f'<p class="note">{escape(line)}</p>' for line in speculative_lines(result))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Linnet bench · {escape(result.model)}</title><style>{STYLE}</style></head>
<body>
<p class="sub">Linnet bench</p>
<h1>{escape(result.model.rstrip('/').split('/')[-1])}</h1>
<p class="sub">{escape(header(result))} · measured {escape(result.env['date'])}</p>
<p class="env">{escape(describe(result.env))}</p>
<h2>Linnet against the stack it replaces</h2>
<p class="sub">Each side on the same machine and checkpoint, in one run with the runs interleaved; a speed-up is how
many times the other's speed. Each row also carries its distance from reference (the largest absolute logit
difference from transformers on the same input), so that a fast wrong answer cannot look like a win.</p>
{headline_cards(rs)}
{''.join(sections)}
<h2>Every number</h2>
<p class="sub">{escape(roofline_line(result))} Load time is from a cold process to a model that has produced a token.
Peak memory is {escape(_memory_source(rs))}.</p>
{every_number(rs)}
{speculative}{reproduce}
</body></html>
"""


def _memory_source(rs: list[dict]) -> str:
    sources = sorted({r["memory_source"] for r in rs if r.get("memory_source")})
    return ", ".join(sources) or "not measured"


def render_serving(result: ServingResult) -> str:
    """The serving bench as a page: a chart per headline metric and the table of every number."""
    rows_ = [{**r.to_json(), "status": "ok" if not r.failed else "failed", "stack": "Serving many requests",
              "linnet": r.target != "url", "key": r.target} for r in result.targets]
    metrics = (Metric("output_tok_s", "Serving throughput", "tok/s", True),
               Metric("ttft_ms_median", "Time to first token, median", "ms", False),
               Metric("itl_ms_median", "Inter-token latency, median", "ms", False),
               Metric("e2e_ms_p99", "End to end, p99", "ms", False))
    charts = "".join(f"<h2>{escape(m.title)}</h2><p class=\"sub\">{escape(m.unit)}, "
                     f"{'higher' if m.higher_is_better else 'lower'} is better; the best bar is red.</p>{chart(rows_, m)}"
                     for m in metrics)
    head = "<tr><th>target</th>" + "".join(f"<th>{escape(c[0])}</th>" for c in serving_report.COLUMNS) + "</tr>"
    body = "".join("<tr><td>" + escape(r.label) + "</td>" +
                   "".join(f"<td>{escape(serving_report.cell(r, k, f))}</td>" for _, k, f in serving_report.COLUMNS)
                   + "</tr>" for r in result.targets)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Linnet serving bench · {escape(result.model)}</title>
<style>{STYLE}</style></head><body>
<p class="sub">Linnet serving bench</p><h1>{escape(result.model.rstrip('/').split('/')[-1])}</h1>
<p class="sub">{escape(serving_report.header(result))} · measured {escape(result.environment['date'])}</p>
<p class="env">{escape(describe(result.environment))}</p>
{charts}<h2>Every number</h2><table>{head}{body}</table></body></html>
"""
