"""Prefix-aware routing's policy, without Ray: the keys requests are placed by, the rendezvous order
(stable, spread, and moving only a leaving replica's keys) and the spill past a busy owner."""

from __future__ import annotations

from collections import Counter

from linnet_core.serve.prefix_routing import KEY_CHARS, placement, rank, rendezvous_order, route_key

SYSTEM = {"role": "system", "content": "Answer briefly."}


def test_a_conversations_turns_share_its_key():
    first = [SYSTEM, {"role": "user", "content": "What is a list?"}]
    later = first + [{"role": "assistant", "content": "A sequence."}, {"role": "user", "content": "And a tuple?"}]
    assert route_key({"messages": first}, chat=True) == route_key({"messages": later}, chat=True)
    other = [SYSTEM, {"role": "user", "content": "What is a dict?"}]
    assert route_key({"messages": other}, chat=True) != route_key({"messages": first}, chat=True)


def test_a_long_shared_head_is_one_key_whatever_follows():
    head = "Shared instructions. " * 40
    keys = {route_key({"prompt": head + f"question {i}"}, chat=False) for i in range(5)}
    assert len(keys) == 1 and len(next(iter(keys))) == KEY_CHARS
    parts = [{"type": "text", "text": head}]  # content as a list of parts reads as its text
    assert route_key({"messages": [{"role": "user", "content": parts}]}, chat=True) == route_key(
        {"messages": [{"role": "user", "content": head}]}, chat=True)


def test_keys_of_batches_token_ids_and_bad_bodies():
    assert route_key({"prompt": ["first prompt", "second"]}, chat=False) == "first prompt"
    assert route_key({"prompt": [1, 2, 3]}, chat=False) == "1,2,3"
    assert route_key({"prompt": [[4, 5], [6]]}, chat=False) == "4,5"
    for body in (None, [], {"prompt": 3}, {"prompt": ""}, {"messages": "x"}, {"messages": [1]}):
        assert route_key(body, chat=False) is None and route_key(body, chat=True) is None


def test_rendezvous_order_spreads_keys_and_moves_only_a_leaving_replicas():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"key {i}" for i in range(2000)]
    owners = {k: rendezvous_order(k, replicas)[0] for k in keys}
    counts = Counter(owners.values())
    assert set(counts) == set(replicas) and min(counts.values()) > 400  # about 500 each
    after = {k: rendezvous_order(k, [r for r in replicas if r != "r2"])[0] for k in keys}
    moved = {k for k in keys if owners[k] != after[k]}
    assert moved == {k for k in keys if owners[k] == "r2"}  # nobody else's prefixes move
    assert rendezvous_order("key 7", replicas) == rendezvous_order("key 7", list(reversed(replicas)))


def test_the_owner_takes_a_request_until_it_is_busy_then_the_next_two_share_it():
    loads = {"a": 0, "b": 0, "c": 0, "d": 0}
    order = rendezvous_order("k", list(loads))
    ranks, owner = rank("k", loads, busy_at=4)
    assert owner == order[0] and ranks == [[order[0]], order[1:3], order[3:]]
    ranks, owner = rank("k", {**loads, order[0]: 4}, busy_at=4)
    assert owner == order[0] and ranks == [order[1:3], order[3:], [order[0]]]
    assert rank("k", {"a": None}, busy_at=1) == ([["a"]], "a")  # one replica: it, busy or not
    assert rank(None, loads, busy_at=4) == ([["a", "b", "c", "d"]], None)  # no key: Ray's shortest queue


def test_placement_names_how_a_request_was_placed():
    assert placement("a", "a") == "owner" and placement("a", "b") == "spilled" and placement(None, "a") == "unkeyed"
