"""The board of a Linnet application on Ray: each live replica's model, actor name and latest metrics
text, which the front's /metrics reads (each sample labelled with its model and replica) and the
tests use to find a replica's actor. Replicas report when their metrics change and say goodbye when
they stop; one killed without a goodbye drops out after STALE_S."""

from __future__ import annotations

import threading
import time

import ray

NAMESPACE = "linnet"
REPORT_S = 0.5  # how often a replica's metrics reach the board
STALE_S = 30.0  # a replica silent this long (killed without a goodbye) leaves /metrics


@ray.remote(num_cpus=0)
class Board:
    """Each live replica's model, actor name and latest metrics text."""

    def __init__(self):
        self.entries: dict[str, dict] = {}

    def report(self, replica: str, entry: dict) -> None:
        self.entries[replica] = {**entry, "at": time.time()}

    def remove(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def read(self) -> dict[str, dict]:
        now = time.time()
        self.entries = {k: v for k, v in self.entries.items() if now - v["at"] < STALE_S}
        return dict(self.entries)


def board(app_name: str):
    """The application's board, created by whoever asks first."""
    return Board.options(name=f"board-{app_name}", namespace=NAMESPACE, get_if_exists=True,
                         lifetime="detached").remote()


class Reporter(threading.Thread):
    """Sends a replica's metrics to the board when they change (checked every REPORT_S, never on a
    request's path: a push after each request delayed the next one), and says goodbye when stopped."""

    def __init__(self, app_name: str, replica: str, entry: dict, metrics):
        super().__init__(daemon=True, name="linnet-metrics-reporter")
        self.board, self.replica, self.entry, self.metrics = board(app_name), replica, entry, metrics
        self.wake, self.done = threading.Event(), False

    def run(self):
        last = None
        while not self.done:
            text = self.metrics()
            if text != last:
                self.board.report.remote(self.replica, {**self.entry, "metrics": text})
                last = text
            self.wake.wait(REPORT_S)

    def stop(self):
        self.done = True
        self.wake.set()
        self.board.remove.remote(self.replica)
