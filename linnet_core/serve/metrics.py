"""Serving metrics in fixed memory: histograms are bucket counts with a sum, so a scrape costs the
same after a billion tokens as after one."""

from __future__ import annotations

import bisect
import threading

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Prometheus-style: counts per upper bound (cumulated when rendered), sum and count."""

    def __init__(self, bounds: tuple[float, ...] = BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def merge(self, other: Histogram) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.sum += other.sum

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            total += c
            lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
        total += self.counts[-1]
        return lines + [f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_sum {self.sum}", f"{name}_count {total}"]


class EngineMetrics:
    """Counters and histograms the engine updates (when a request finishes, for the histograms) and
    a scrape reads under the same lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests_total = self.requests_finished = self.tokens_generated = 0
        self.finished_by_reason: dict[str, int] = {}
        self.ttft = Histogram()
        self.inter_token = Histogram()
        self.prompt_tokens = self.prefix_queries = self.prefix_hits = self.prefix_reused_tokens = 0
        self.draft_proposed = self.draft_accepted = self.draft_checks = 0  # speculative decoding

    def drafted(self, proposed: int, accepted: int) -> None:
        """A row's draft was checked: `accepted` of its `proposed` tokens kept (call under the lock)."""
        self.draft_proposed += proposed
        self.draft_accepted += accepted
        self.draft_checks += 1

    def admitted(self, prompt_tokens: int, reused: int) -> None:
        """A request took a row, `reused` of its prompt's positions found cached (call under the lock)."""
        self.prompt_tokens += prompt_tokens
        self.prefix_queries += 1
        self.prefix_hits += reused > 0
        self.prefix_reused_tokens += reused

    def caught_up(self, first: bool, tokens: int) -> None:
        """A filling request copied `tokens` more positions another row filled meanwhile (under the lock)."""
        self.prefix_hits += first
        self.prefix_reused_tokens += tokens

    def finished(self, reason: str, ttft: float | None, inter_token: Histogram) -> None:
        with self.lock:
            self.requests_finished += 1
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            self.inter_token.merge(inter_token)


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` in Prometheus text whose labels include `labels` (a scrape's
    reader: the Ray bench and tests read replicas' counters from the ingress's /metrics with it)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
