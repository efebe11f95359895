"""Linnet's bf16 GEMV kernel (backends/kernels/gemv_bf16.cpp) against F.linear, and where sessions use it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from linnet_core.backends import bf16_gemv
from linnet_core.backends.cpu_kernels import DecodeLinear, linear_kernel


@pytest.fixture(scope="module")
def gemv():
    fn = bf16_gemv.kernel()
    if fn is None:
        pytest.skip(f"the bf16 GEMV kernel does not run here: {bf16_gemv.why_not()}")
    return fn


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("out_features", [8, 83, 640])  # whole passes of 8 rows, a ragged tail, many tasks
@pytest.mark.parametrize("in_features", [32, 96, 2560])
def test_gemv_matches_f_linear(gemv, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(1, rows, in_features, generator=g).to(torch.bfloat16)  # [B, T, K] as a step has it
    got = bf16_gemv.decode_linear(x, w)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float())  # float32 accumulation both ways: only the last rounding differs
    assert torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def test_bias_and_what_the_kernel_leaves_to_f_linear(gemv):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    for x in (torch.randn(1, 1, 64, generator=g), torch.randn(1, 5, 64, generator=g),  # prefill rows
              torch.randn(1, 1, 64, generator=g)[..., ::2].repeat(1, 1, 2)):  # non-contiguous view made whole
        x = x.to(torch.bfloat16)
        want = F.linear(x.float(), w.float(), b.float())
        assert torch.allclose(bf16_gemv.decode_linear(x, w, b).float(), want, atol=0.1, rtol=2e-2)
    odd = torch.randn(24, 48, generator=g).to(torch.bfloat16)  # in_features not a multiple of 32
    x = torch.randn(1, 1, 48, generator=g).to(torch.bfloat16)
    assert torch.equal(bf16_gemv.decode_linear(x, odd), F.linear(x, odd))


def test_bf16_linears_take_the_kernel_and_float32_keeps_onednn(gemv):
    assert linear_kernel(torch.bfloat16) is DecodeLinear
    assert linear_kernel(torch.float32) is not DecodeLinear


def test_turned_off_or_unbuildable_means_onednn_not_an_error():
    code = ("from linnet_core.backends import bf16_gemv, cpu_kernels; import torch; "
            "print(bf16_gemv.kernel() is None, bf16_gemv.why_not(), "
            "getattr(cpu_kernels.linear_kernel(torch.bfloat16), '__name__', 'None'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LINNET_CPU_GEMV": "0"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True" and "LINNET_CPU_GEMV=0" in " ".join(out)
    assert out[-1] in ("PackedLinear", "None")


@pytest.mark.slow
def test_a_fresh_machine_builds_the_kernel(gemv, tmp_path):
    """What a first bfloat16 session does on a new machine: build into an empty folder (~25 s), with
    only the system's PATH (the ninja wheel's folder is added by the builder, not by an activated venv)."""
    code = "from linnet_core.backends import bf16_gemv as g; print(g.kernel() is not None, g.why_not())"
    env = {**os.environ, "LINNET_KERNELS": str(tmp_path / "kernels"),
           "PATH": os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                   if not p.startswith(sys.prefix))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("True"), out.stdout + out.stderr
    assert list((tmp_path / "kernels").glob("gemv_bf16-*/*.so"))
