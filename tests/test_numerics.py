"""Every family and feature against transformers (eager), in numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_fixtures import CASE_IDS, CPU_BACKENDS, HALF_DTYPES

from linnet_core.compile import load_model
from linnet_core.check.reference import load_reference, run_reference
from linnet_core.check.agreement import TOLERANCE
from linnet_core.check.verify import verify

STEPS = 8
PROMPT = [3, 17, 42, 7, 99, 120, 5, 64, 33, 150, 11, 2]  # 12 tokens: longer than the window-8 fixtures


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASE_IDS)
def test_float32_matches_transformers(case, backend, checkpoints, reference):
    r = verify(checkpoints[case], backend, "float32", steps=STEPS, reference=reference(case))
    assert r.prompt_tokens + r.steps >= 20
    assert r.distance <= 1e-4, r
    assert r.tokens_match, (r.reference_tokens, r.backend_tokens)
    assert r.top1_agreement == 1.0
    assert r.passed


@pytest.mark.parametrize("backend,dtype", HALF_DTYPES)
@pytest.mark.parametrize("case", CASE_IDS)
def test_half_dtypes_within_tolerance(case, backend, dtype, checkpoints, reference, monkeypatch):
    # The XLA backends refuse 16-bit on a CPU for its speed; their 16-bit math is still checked here.
    monkeypatch.setattr("linnet_core.backends.jax_backend.REFUSE_HALF_ON_CPU", False)
    r = verify(checkpoints[case], backend, dtype, steps=STEPS, reference=reference(case))
    assert r.dtype == dtype
    assert 0 < r.distance <= r.tolerance, r
    assert r.tolerance <= TOLERANCE[dtype] * 50.0
    assert r.passed


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["llama-gqa-untied", "mistral-window", "qwen3-headdim128", "phi3-fused-window"])
def test_rows_decoded_together_match_each_alone(case, backend, checkpoints):
    session, _ = load_model(checkpoints[case], backend, "float32", 64, rows=3)
    prompts = {0: PROMPT[:5], 2: PROMPT[3:12]}  # different lengths, so rows sit at different positions

    def alone(slot, prompt):
        tokens = [session.prefill(prompt, slot=slot).tokens[0]]
        for k in range(STEPS):
            tokens.append(session.decode([tokens[-1]], [len(prompt) + k], [slot]).tokens[0])
        return tokens

    expected = {slot: alone(slot, p) for slot, p in prompts.items()}
    together = {slot: [session.prefill(p, slot=slot).tokens[0]] for slot, p in prompts.items()}
    for k in range(STEPS):
        slots = list(prompts)
        out = session.decode([together[s][-1] for s in slots], [len(prompts[s]) + k for s in slots], slots)
        for s, t in zip(slots, out.tokens):
            together[s].append(t)
    assert together == expected


def test_decode_logits_batched_equal_single(checkpoints):
    """Batching changes which GEMM kernel runs, not the numbers beyond rounding."""
    path = checkpoints["qwen2-bias-tied"]
    session, _ = load_model(path, "torch", "float32", 64, rows=2)
    for slot in (0, 1):
        session.prefill(PROMPT[: 4 + slot], slot=slot)
    single = [session.decode([7], [4 + s], [s], logits=True).logits[0, -1] for s in (0, 1)]
    both = session.decode([7, 7], [4, 5], [0, 1], logits=True).logits[:, -1]
    np.testing.assert_allclose(both, np.stack(single), atol=1e-5)


def test_reference_teacher_forcing_is_consistent(checkpoints):
    """The reference's incremental decode equals one full forward over the same tokens."""
    path = checkpoints["llama-gqa-untied"]
    model = load_reference(path)
    run = run_reference(model, PROMPT, 4)
    full = PROMPT + run.tokens[:4]
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].numpy()
    np.testing.assert_allclose(run.logits, logits, atol=1e-5)


def test_sampling_is_seeded_and_chosen_on_device(checkpoints):
    from linnet_core.runtime.generate import Generation
    from linnet_core.runtime.sampling import Sampler, SamplingParams

    session, _ = load_model(checkpoints["qwen3-headdim128"], "torch", "float32", 64)

    def sample(seed):
        sampler = Sampler(SamplingParams(temperature=1.5, top_p=0.9, top_k=50, seed=seed))
        return list(Generation(session, PROMPT, 12, sampler))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = list(Generation(session, PROMPT, 12))
    assert list(Generation(session, PROMPT, 12, Sampler(SamplingParams(temperature=1.0, top_k=1)))) == greedy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen3-headdim128", "phi3-fused-window", "qwen3moe-experts",
                                  "mixtral-experts"])
def test_cuda_session_matches_transformers(case, dtype, checkpoints, reference):
    r = verify(checkpoints[case], "torch", dtype, steps=STEPS, reference=reference(case),
               device="cuda")
    assert r.passed, r
    if dtype == "float32":
        assert r.tokens_match


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["jax", "stablehlo"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["llama-gqa-untied", "phi3-fused-window"])
def test_xla_cuda_matches_transformers(backend, case, dtype, checkpoints, reference, request):
    """XLA's CUDA client. The first GPU pass found both XLA backends in bf16 on phi3-fused-window at
    0.311 against a tolerance of 0.259, tokens all matching (torch on CUDA 0.217; JAX on the CPU 0.187,
    and 0.217, torch's figure to the bit, with XLA rounding every op): open, see docs/gpu.md."""
    if case == "phi3-fused-window" and dtype == "bfloat16":
        request.applymarker(pytest.mark.xfail(reason="XLA CUDA bf16 past the tolerance (first GPU pass)"))
    pytest.importorskip("jax")
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this JAX has no CUDA plugin")
    r = verify(checkpoints[case], backend, dtype, steps=STEPS, reference=reference(case), device="cuda")
    assert r.passed, r
