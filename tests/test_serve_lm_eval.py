"""lm-eval's `local-completions` against a running server, as evaluation harnesses score models: a
multiple-choice task (a local YAML over a small JSON file, tests/lm_eval/) runs to the end, the
server's tokenizer used remotely (/tokenizer_info, /tokenize), and every choice's log-likelihood equals
Linnet's own teacher-forced computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.serve.engine import Engine  # noqa: E402
from linnet_core.serve.http import Limits, Server, create_app  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402
from server_fixtures import app_in_thread  # noqa: E402

TASK = Path(__file__).parent / "lm_eval"


def test_lm_eval_scores_choices_as_linnet_computes_them(tokenized_checkpoints, tmp_path):
    from lm_eval.tasks import TaskManager

    path = tokenized_checkpoints["qwen2-bias-tied"]
    session, _ = load_model(path, "torch", "float32", 128, rows=2)
    alone, _ = load_model(path, "torch", "float32", 128, rows=1)
    tok = Tokenizer(path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = (TASK / "linnet_choice.yaml").read_text().replace("DATA_FILE", str(TASK / "choices.jsonl"))
    (tasks / "linnet_choice.yaml").write_text(yaml)
    app = create_app(Server(Engine(session, tok, prefill_chunk=32), tok, "tiny", Limits(max_tokens=64)))
    with app_in_thread(app) as url:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["linnet_choice"], task_manager=TaskManager(include_path=str(tasks)),
            model_args=f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=2,"
                       "max_retries=1", log_samples=True, random_seed=0)
    assert 0 <= out["results"]["linnet_choice"]["acc,none"] <= 1
    samples = out["samples"]["linnet_choice"]
    assert len(samples) == 4
    checked = 0
    for sample in samples:
        for (context, continuation), (loglik, _greedy) in zip((r for r in sample["arguments"]),
                                                              (r[0] for r in sample["resps"]), strict=True):
            spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
            context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
            whole = tok.encode(context + continuation, add_special_tokens=False)
            ctx = tok.encode(context, add_special_tokens=False)
            logp = torch.from_numpy(alone.prefill(whole, logits="all").logits[0]).log_softmax(-1).numpy()
            want = sum(float(logp[j - 1][whole[j]]) for j in range(len(ctx), len(whole)))
            np.testing.assert_allclose(loglik, want, atol=1e-3)
            checked += 1
    assert checked == 11  # every choice of every question
