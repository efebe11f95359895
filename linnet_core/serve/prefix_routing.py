"""Which replica serves a request: the one whose prefix cache most likely holds its prompt's start.

A request's key is the head of its prompt: a completion's first characters, or a chat's messages up
to and including its first user message (what every later turn of that conversation repeats), capped
at `KEY_CHARS`. Replicas are ranked for a key by rendezvous hashing (highest random weight), a
consistent hash that needs no shared state: every ingress ranks alike, and a replica joining or
leaving moves only the keys it wins or held. The owner takes the request unless it is busy (its
requests in flight reach `busy_at`, the rows it decodes together); then the next two in the key's
order are offered as one rank, of which Ray's router takes the shorter queue (power of two choices),
so a hot prefix spills onto a stable second home instead of everywhere.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

KEY_CHARS = 256  # ~64 tokens: past the first cache blocks, short enough that a conversation's turns agree


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def route_key(body: Any, chat: bool) -> str | None:
    """The routing key of a parsed request body; None when it has no prompt to key on."""
    if not isinstance(body, dict):
        return None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        head = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            head.append(f"{m.get('role')}\x1f{_text(m.get('content'))}\x1e")
            if m.get("role") == "user":
                break
        text = "".join(head)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, list):  # token ids
            text = ",".join(str(t) for t in prompt[:KEY_CHARS // 4])
        elif isinstance(prompt, str):
            text = prompt
        else:
            return None
    return text[:KEY_CHARS] or None


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """The replicas in the key's order of preference (highest hash weight first)."""
    return sorted(replicas, key=lambda r: _weight(key, r), reverse=True)


def rank(key: str | None, loads: dict[str, int | None], busy_at: int) -> tuple[list[list[str]], str | None]:
    """Ranks of replica ids to try in turn, and the key's owner (None for no key). `loads` maps each
    candidate to its requests in flight (None: not known, taken as idle). Unkeyed requests (no
    prompt) get every replica as one rank: Ray picks the shortest queue."""
    ids = list(loads)
    if key is None:
        return [ids], None
    order = rendezvous_order(key, ids)
    owner, rest = order[0], order[1:]
    tail = [rest[2:]] if rest[2:] else []
    if (loads[owner] or 0) < busy_at or not rest:
        return [[owner], *([rest[:2]] if rest else []), *tail], owner
    return [rest[:2], *tail, [owner]], owner


def placement(owner: str | None, replica: str) -> str:
    """How a request was placed: on its key's owner, spilled past it (busy), or unkeyed."""
    return "unkeyed" if owner is None else "owner" if owner == replica else "spilled"
