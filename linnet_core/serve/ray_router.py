"""Ray Serve's request router for Linnet's replicas: prefix affinity (`prefix_routing`) over the queue
lengths Ray's router already keeps. It runs inside the ingress's deployment handles, one per model;
Ray Serve loads it by its import path (`RequestRouterConfig`).

Why not `ray.serve.llm`'s PrefixCacheAffinityRouter: it comes with `ray[llm]` (vLLM and its stack),
and its prefix tree lives in one actor every routing decision waits on; a rendezvous hash needs no
shared state at all.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from .prefix_routing import rank


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by the request's `route_key` keyword argument, and sets its `owner` one (the
    key's first choice). Not FIFO-mixed on purpose: a replica found for one request must go to that
    request, not to the oldest one waiting. Ray ships this class by value: it keeps no module state."""

    def initialize_state(self, busy_at: int = 8):
        self.busy_at = busy_at
        # requests this router has in flight per replica: Ray's own queue-length cache runs only in its
        # strict max_ongoing_requests mode
        self.in_flight: Counter = Counter()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {i: max(self.in_flight[r.replica_id], self.replica_queue_len_cache.get(r.replica_id) or 0)
                 for i, r in by_id.items()}
        ranks, owner = rank(_key(pending_request), loads, self.busy_at)
        if pending_request is not None:  # travels with the request: the ingress learns whether the owner took it
            pending_request.kwargs["owner"] = owner
        return [[by_id[i] for i in group] for group in ranks]


    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)


def _key(pending_request: Optional[PendingRequest]) -> str | None:
    return pending_request.kwargs.get("route_key") if pending_request is not None else None
