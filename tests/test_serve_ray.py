"""`linnet serve --ray` on a local Ray cluster started here (2 replicas of each of two tiny models, 1
CPU each, a 256 MiB object store): the OpenAI client through the front, the API key, prefix
affinity (the replicas' own prefix-cache counters say where requests went), a replica killed
mid-stream, two models routed by name, compiled artifacts shared through the store, and draining
when the application goes."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'linnet[ray]')")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint  # noqa: E402
from tokenizer_fixtures import write_tokenizer  # noqa: E402

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.serve import free_port  # noqa: E402
from linnet_core.serve.config import ServeConfig  # noqa: E402
from linnet_core.serve.metrics import sample_sum  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

APP = "linnet-test"
KEY = "sk-ray-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CACHE = 2048  # room for a stream long enough to kill its replica in the middle of
SYSTEM = "You are a careful assistant. " * 12  # longer than the routing key: every request shares its head


def _checkpoint(root, case_id: str, **overrides):
    case = next(c for c in CASES if c.id == case_id)
    folder = make_checkpoint(case, root / case_id, vocab_size=TOKENIZED_VOCAB, **overrides)
    write_tokenizer(folder, case.tokenizer, TOKENIZED_VOCAB)
    return folder


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, session_cache):
    from ray import serve

    from linnet_core.serve import ray_app

    root = tmp_path_factory.mktemp("ray-models")
    tiny = _checkpoint(root, "qwen2-bias-tied", max_position_embeddings=CACHE)
    second = _checkpoint(root, "llama-gqa-untied")
    store = tmp_path_factory.mktemp("artifact-store")
    before = os.environ.get("LINNET_CACHE")
    os.environ["LINNET_CACHE"] = str(session_cache)  # the cluster's workers inherit it
    ray_app.connect(num_cpus=6, object_store_memory=256 << 20)
    models = [ray_app.ModelSpec("tiny", ServeConfig(str(tiny), dtype="float32", rows=4, cache_len=CACHE)),
              ray_app.ModelSpec("second", ServeConfig(str(second), dtype="float32", rows=4, cache_len=128))]
    deployed = None
    try:
        deployed = ray_app.deploy(models, ray_app.Scaling(replicas=2, artifact_store=str(store), drain_timeout=60),
                                  "127.0.0.1", free_port(), app_name=APP, api_key=KEY)
        _wait_for_replicas(APP, {"tiny": 2, "second": 2})
        yield {"url": deployed.url, "base": f"http://127.0.0.1:{deployed.front.port}", "deployed": deployed,
               "models": models, "tiny": tiny, "second": second, "store": store}
    finally:
        if deployed is not None:
            deployed.close()  # the last test closes it already; again is harmless
        serve.shutdown()
        ray.shutdown()
        if before is None:
            os.environ.pop("LINNET_CACHE", None)
        else:
            os.environ["LINNET_CACHE"] = before


def _board(app: str = APP) -> dict[str, dict]:
    from linnet_core.serve import ray_app

    return ray.get(ray_app.board(app).read.remote())


def _wait_for_replicas(app: str, wanted: dict[str, int], timeout: float = 240, without: str | None = None):
    deadline = time.monotonic() + timeout
    while True:
        entries = {k: v for k, v in _board(app).items() if k != without}
        counts = {m: sum(e["model"] == m for e in entries.values()) for m in wanted}
        if counts == wanted:
            return entries
        assert time.monotonic() < deadline, f"replicas did not come up: {counts}, wanted {wanted}"
        time.sleep(0.5)


def _alone_ids(path, prompt: str, n: int) -> list[int]:
    session, _ = load_model(path, "torch", "float32", CACHE if "qwen2" in str(path) else 128, rows=1)
    return list(Generation(session, Tokenizer(path).encode(prompt), n))


def _alone(path, prompt: str, n: int) -> str:
    return Tokenizer(path).decode(_alone_ids(path, prompt, n))


def test_the_openai_client_through_the_front(cluster):
    client = openai.OpenAI(base_url=cluster["url"], api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "second"]
    r = client.completions.create(model="tiny", prompt="The list object", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == _alone(cluster["tiny"], "The list object", 12)  # greedy: as one session alone
    assert r.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content


def test_the_api_key_and_errors_as_linnet_serve_gives_them(cluster):
    base = cluster["base"]
    assert httpx.get(f"{base}/health").json()["status"] == "ok"  # /health needs no key
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster["url"], api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # the replica's own words
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, content=b"{bad")
    assert r.status_code == 415
    r = httpx.post(f"{base}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=b"{bad")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_two_models_routed_by_name(cluster):
    base, client = cluster["base"], openai.OpenAI(base_url=cluster["url"], api_key=KEY, max_retries=0)
    second = client.completions.create(model="second", prompt="The list object", max_tokens=6, temperature=0,
                                       logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert second.model == "second"  # its tokens (random weights: text may split a character) as it alone gives
    assert [int(t.split(":")[1]) for t in second.choices[0].logprobs.tokens] == _alone_ids(
        cluster["second"], "The list object", 6)
    replicas = {k: v["model"] for k, v in _board().items()}
    for model in ("tiny", "second"):
        r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": model, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200 and replicas[r.headers["x-linnet-replica"]] == model
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "third", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'tiny'" in r.json()["error"]["message"] and "'second'" in r.json()["error"]["message"]


def test_a_shared_prefix_lands_on_the_replica_that_caches_it(cluster):
    base = cluster["base"]
    before = httpx.get(f"{base}/metrics", headers=AUTH).text
    seen = []
    for i in range(6):  # one system prompt, six users: one replica computes it once and reuses it
        r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": f"question {i}"}]})
        assert r.status_code == 200, r.text
        seen.append(r.headers["x-linnet-replica"])
    assert len(set(seen)) == 1
    owner = seen[0]
    time.sleep(1.5)  # the replicas' counters reach the board within REPORT_S of a request's end
    after = httpx.get(f"{base}/metrics", headers=AUTH).text
    hits = {rid: sample_sum(after, "linnet_prefix_cache_hits_total", replica=rid)
            - sample_sum(before, "linnet_prefix_cache_hits_total", replica=rid)
            for rid, e in _board().items() if e["model"] == "tiny"}
    assert hits[owner] >= 5 and sum(hits.values()) == hits[owner], hits
    placed = sample_sum(after, "linnet_ray_routed_total", model="tiny", placement="owner") - sample_sum(
        before, "linnet_ray_routed_total", model="tiny", placement="owner")
    assert placed >= 6
    assert sample_sum(after, "linnet_ray_forward_overhead_seconds_count") >= 6
    # a burst of eight with that prefix: the owner takes its rows' worth, the rest spill to the other
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        return httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "max_tokens": 64, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"burst {i}"}]})

    with ThreadPoolExecutor(8) as pool:
        burst = [r.headers["x-linnet-replica"] for r in pool.map(ask, range(8))]
    assert burst.count(owner) == 4 and len(set(burst)) == 2, burst  # the owner's 4 rows, then the next choice
    # distinct prompts spread: eight keys all on one of two replicas would be a 1-in-128 chance
    spread = {httpx.post(f"{base}/v1/completions", headers=AUTH, json={
        "model": "tiny", "prompt": f"{i} distinct opening words", "max_tokens": 1}).headers["x-linnet-replica"]
        for i in range(8)}
    assert len(spread) == 2


def test_a_second_front_joins_the_running_application(cluster):
    """Fronts agree on a prompt's replica without talking to each other (the hash needs no shared
    state); one that joins leaves the application running when it goes."""
    from linnet_core.errors import InputError
    from linnet_core.serve import ray_app

    joined = ray_app.deploy(cluster["models"], ray_app.Scaling(replicas=2), "127.0.0.1", 0, app_name=APP,
                            api_key=KEY, join=True)
    try:
        body = {"model": "tiny", "prompt": SYSTEM + "from either front", "max_tokens": 3, "temperature": 0}
        first = httpx.post(f"{cluster['base']}/v1/completions", headers=AUTH, json=body)
        second = httpx.post(f"http://127.0.0.1:{joined.front.port}/v1/completions", headers=AUTH, json=body)
        assert first.status_code == second.status_code == 200
        assert first.headers["x-linnet-replica"] == second.headers["x-linnet-replica"]
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        with pytest.raises(InputError, match="already runs on this cluster"):  # a second deployer would clobber it
            ray_app.deploy(cluster["models"], ray_app.Scaling(replicas=2), "127.0.0.1", 0, app_name=APP)
        with pytest.raises(InputError, match="nothing to join"):
            ray_app.deploy(cluster["models"], ray_app.Scaling(), "127.0.0.1", 0, app_name="elsewhere", join=True)
    finally:
        joined.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{joined.front.port}/health")
    r = httpx.post(f"{cluster['base']}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "still here",
                                                                          "max_tokens": 1})
    assert r.status_code == 200  # the application the first front deployed runs on


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error(cluster):
    base = cluster["base"]
    actors = {k: v["actor"] for k, v in _board().items() if v["model"] == "tiny"}
    events, killed = [], None
    body = {"model": "tiny", "prompt": "The list object", "max_tokens": CACHE - 16, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers["x-linnet-replica"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                ray.kill(ray.get_actor(actors[replica], namespace="serve"))
                killed = replica
    assert killed and time.monotonic() - started < 60  # no hang
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and "mid-stream" in error["message"]
    assert len(events) < CACHE - 16  # it ended early, by the error
    # the front answers at once (the other replica), and Ray starts a replica in the dead one's place
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "again", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-linnet-replica"] != killed
    _wait_for_replicas(APP, {"tiny": 2, "second": 2}, without=killed)


def test_replicas_share_compiled_artifacts_through_the_store(cluster):
    published = sorted(p.name for p in (cluster["store"] / "artifacts").iterdir())
    assert any(n.startswith("tiny") or "qwen2" in n for n in published)
    assert len(published) >= 2  # each model compiled once, published for every other replica
    for entry in (cluster["store"] / "artifacts").iterdir():
        manifest = json.loads((entry / "manifest.json").read_text())
        assert all((entry / name).stat().st_size == meta["size"] for name, meta in manifest["files"].items())


def test_deleting_the_application_lets_requests_in_flight_finish(cluster):
    """Scale-down and shutdown drain: the app's replicas finish what they hold before they go."""
    base, reasons, lines = cluster["base"], [], []

    def stream():
        body = {"model": "tiny", "prompt": "The list object", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    reader = threading.Thread(target=stream)
    reader.start()
    while len(lines) < 4:
        time.sleep(0.01)
    closing = threading.Thread(target=cluster["deployed"].close)  # returns once the replicas are gone
    closing.start()
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{base}/health")).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 503 and r.headers["retry-after"]  # new requests are turned away at once...
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "late"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    reader.join(timeout=120)
    closing.join(timeout=120)
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and reasons[-1] == "length", events[-3:]  # ...those in flight finish
    with pytest.raises(httpx.ConnectError):  # and then the front was gone
        httpx.get(f"{base}/health")


def test_a_model_that_does_not_open_is_one_line_before_anything_deploys(tmp_path, monkeypatch):
    from test_cli import assert_one_line_error, invoke

    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    assert_one_line_error(invoke("serve", "/missing/folder", "--ray"), 1, "no model '/missing/folder'")
    assert_one_line_error(invoke("serve", "--ray", "--model", "/missing/other"), 1, "no model '/missing/other'")


def test_a_taken_port_is_one_line_before_anything_deploys(tmp_path, monkeypatch):
    from test_cli import assert_one_line_error, invoke

    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        r = invoke("serve", "--ray", "--port", str(port))
    assert_one_line_error(r, 1, f"cannot listen on 127.0.0.1:{port}")  # taken before Ray is asked for anything
