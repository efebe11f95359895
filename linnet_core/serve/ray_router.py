"""Ray Serve's request router for Linnet's replicas: prefix affinity (`prefix_routing`) over the loads
this router has placed. It runs inside the front's deployment handles, one per model.

Why not `ray.serve.llm`'s PrefixCacheAffinityRouter: it comes with `ray[llm]` (vLLM and its stack),
and its prefix tree lives in one actor every routing decision waits on; a rendezvous hash needs no
shared state at all.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .prefix_routing import rank

FORGET_S = 3600.0  # a placement never completed (cancelled before it was sent) stops counting after this


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by the request's `route_key` keyword argument, and sets its `owner` one (the
    key's first choice). Not FIFO-mixed on purpose: a replica found for one request must go to that
    request, not to the oldest one waiting. Ray ships this class by value: it keeps no module state."""

    def initialize_state(self, busy_at: int = 8):
        self.busy_at = busy_at
        # request id -> (the replica it was placed on, when), until it completes. Counted from the moment
        # of choosing, not of sending: a burst's requests are all chosen before any is sent, and would
        # otherwise all see the owner idle. (Ray's own queue-length cache runs in its strict mode only.)
        self.placed: dict[str, tuple[ReplicaID, float]] = {}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        self.placed = {k: v for k, v in self.placed.items() if now - v[1] < FORGET_S}
        counts = Counter(replica for replica, _ in self.placed.values())
        loads = {i: max(counts[r.replica_id], self.replica_queue_len_cache.get(r.replica_id) or 0)
                 for i, r in by_id.items()}
        key = _key(pending_request)
        ranks, owner = rank(key, loads, self.busy_at)
        if pending_request is not None:  # travels with the request: the front learns whether the owner took it
            pending_request.kwargs["owner"] = owner
            if key is not None:  # Ray takes the rank's shorter queue: count it there
                chosen = min(ranks[0], key=lambda i: loads[i] or 0)
                self.placed[pending_request.metadata.internal_request_id] = (by_id[chosen].replica_id, now)
        return [[by_id[i] for i in group] for group in ranks]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.placed.pop(internal_request_id, None)


def _key(pending_request: Optional[PendingRequest]) -> str | None:
    return pending_request.kwargs.get("route_key") if pending_request is not None else None
