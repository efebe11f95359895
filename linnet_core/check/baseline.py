"""Regression gates against a saved run (`--baseline OLD.json`): the same model, dtype and machine,
measured again after an upgrade of torch, a driver, a server or Linnet itself.

bench: a side is slower when its median decode tok/s (or TTFT) moved past `--max-slowdown` and a
one-sided Mann-Whitney U test over the two sets of timed runs puts the drop beyond noise (p ≤ 0.05),
so neither one lucky sample nor a drift within the runs' own spread fails a job.
verify --url: the server's logprobs for the same greedy tokens moved past the dtype's tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

from ..errors import InputError

P_VALUE = 0.05  # the bench gate's significance level
MIN_RUNS = 3  # with fewer timed runs a side no test can tell a drop from noise at P_VALUE


def read_saved(path: Path, key: str, made_by: str) -> dict:
    """A saved --json document that has `key`, or one line saying what the file is instead."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--baseline {path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"--baseline {path}: not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list) or not isinstance(doc.get("environment"), dict):
        raise InputError(f"--baseline {path}: not a saved run of `{made_by} --json`",
                         hint=f"save one with {made_by} --save FILE")
    return doc


def check_machine(old: dict, new: dict, path: Path, other_machine: bool, warn) -> bool:
    """Whether the baseline came from this machine; another is refused unless `other_machine`, then warned."""
    keys = ("host", "cpu", "cpu_kernels", "gpu", "threads", "device")
    differ = [f"{k} {old.get(k)!r} → {new.get(k)!r}" for k in keys if k in old and old.get(k) != new.get(k)]
    if not differ:
        return True
    text = f"--baseline {path} was measured on another machine ({'; '.join(differ)})"
    if not other_machine:
        raise InputError(text, hint="compare on the machine it came from, or pass --other-machine to compare anyway")
    warn(text + ": speeds and roundings need not carry over")
    return False


def versions_changed(old: dict, new: dict) -> list[str]:
    ov, nv = old.get("versions") or {}, new.get("versions") or {}
    return [f"{k} {ov.get(k)} → {nv.get(k)}" for k in sorted(set(ov) | set(nv)) if ov.get(k) != nv.get(k)]


def drop_p_value(old: list[float], new: list[float]) -> float:
    """One-sided Mann-Whitney U: the chance of runs this much lower than the baseline's by noise alone."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(new, old, alternative="less", method="exact" if len(old) + len(new) <= 40
                              else "asymptotic").pvalue)


def bench_gate(new: dict, old: dict, path: Path, max_slowdown: float, other_machine: bool, warn) -> dict:
    """Each side both runs measured, decode tok/s and TTFT against the baseline's; `passed` False on a drop."""
    for field in ("dtype", "model"):
        if old.get(field) != new.get(field):
            raise InputError(f"--baseline {path} measured {field} {old.get(field)!r}, this run {new.get(field)!r}")
    om, nm = old.get("method") or {}, new.get("method") or {}
    differ = [k for k in ("prompt_tokens", "new_tokens", "batch", "cache_len") if om.get(k) != nm.get(k)]
    if differ:
        raise InputError(f"--baseline {path} was measured with other settings ({', '.join(differ)}): "
                         "compare runs of the same command")
    same = check_machine(old["environment"], new["environment"], path, other_machine, warn)
    olds = {s.get("key"): s for s in old["sides"] if isinstance(s, dict)}
    rows = []
    for side in new["sides"]:
        before = olds.get(side["key"])
        if before is None or side.get("status") != "ok" or before.get("status") != "ok":
            continue
        for metric in ("decode_tok_s", "ttft_s"):
            measured = [[s[metric] for s in runs.get("samples") or [] if isinstance(s.get(metric), (int, float))
                         and s[metric] > 0] for runs in (before, side)]
            if min(map(len, measured)) < MIN_RUNS:
                raise InputError(f"--baseline: {side['key']} has {min(map(len, measured))} timed runs; a drop is "
                                 f"told from noise with {MIN_RUNS} or more per side (--runs)")
            # compared as speeds: a time's slowdown is a rise, so TTFT is taken as 1/t
            a, b = measured if metric != "ttft_s" else [[1 / x for x in m] for m in measured]
            change = median(b) / median(a) - 1
            p = drop_p_value(a, b)
            rows.append({"key": side["key"], "metric": metric, "baseline_median": median(measured[0]),
                         "median": median(measured[1]), "speed_change": change, "p_value": p,
                         "runs": [len(a), len(b)], "slower": change < -max_slowdown and p <= P_VALUE})
    slow = [r for r in rows if r["slower"]]
    passed = not slow
    summary = (f"{len(rows)} medians compared (bound {max_slowdown:.0%}, p ≤ {P_VALUE}); "
               + ("; ".join(f"{r['key']} {r['metric']} {-r['speed_change']:.1%} slower (p = {r['p_value']:.3g})"
                            for r in slow) if slow else "none slower"))
    return {"file": str(path), "passed": passed, "same_machine": same, "max_slowdown": max_slowdown,
            "statistic": "median of timed runs; one-sided Mann-Whitney U over the runs", "summary": summary,
            "versions_changed": versions_changed(old["environment"], new["environment"]), "rows": rows}


def verify_gate(report, old: dict, path: Path, other_machine: bool, warn) -> dict:
    """The server's chosen-token logprobs against the baseline's, prompt by prompt, up to the first
    token either run chose differently (a near tie may flip: it is reported, not failed)."""
    for field in ("model", "dtype"):
        if old.get(field) != getattr(report, field):
            raise InputError(f"--baseline {path} checked {field} {old.get(field)!r}, "
                             f"this run {getattr(report, field)!r}")
    same = check_machine(old["environment"], report.environment, path, other_machine, warn)
    olds = {(c.get("name"), c.get("prompt_tokens")): c for c in old["comparisons"] if isinstance(c, dict)}
    worst, flips, unmatched = 0.0, [], 0
    for c in report.comparisons:
        before = olds.get((c.name, c.prompt_tokens))
        if before is None:
            unmatched += 1
            continue
        for j, (t0, t1, l0, l1) in enumerate(zip(before.get("tokens") or [], c.tokens, before.get("logprobs") or [],
                                                 c.logprobs)):
            if t0 != t1:  # another token: its logprob is another token's, not a moved one
                flips.append(f"{c.name} token {j + 1}")
                break
            if isinstance(l0, (int, float)) and isinstance(l1, (int, float)):
                worst = max(worst, abs(l1 - l0))
    passed = worst <= report.tolerance
    summary = (f"the server's logprobs moved at most {worst:.3g} (tolerance {report.tolerance:.3g})"
               + (f"; greedy tokens changed at {', '.join(flips)}" if flips else "; the same greedy tokens")
               + (f"; {unmatched} prompts not in the baseline" if unmatched else ""))
    return {"file": str(path), "passed": passed, "same_machine": same, "max_logprob_change": worst,
            "changed_tokens": flips, "summary": summary,
            "versions_changed": versions_changed(old["environment"], report.environment)}
