"""Session fixtures over the tiny checkpoints of tests/family_fixtures.py: written once per test
session (and shared), some in the legacy config style and one sharded. Nothing touches a network.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {c.id: make_checkpoint(c, root / c.id) for c in CASES}


@pytest.fixture(scope="session")
def tokenized_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every case again with a trained tokenizer (and a vocabulary big enough for byte fallback)."""
    from tokenizer_fixtures import write_tokenizer

    root = tmp_path_factory.mktemp("tokenized")
    out = {}
    for c in CASES:
        folder = make_checkpoint(c, root / c.id, vocab_size=TOKENIZED_VOCAB)
        write_tokenizer(folder, c.tokenizer, TOKENIZED_VOCAB)
        out[c.id] = folder
    return out


@pytest.fixture(scope="session")
def reference(checkpoints):
    """reference(case): the transformers model of a fixture, loaded once per test run."""
    from linnet_core.check.reference import load_reference

    loaded = {}

    def get(case: str):
        if case not in loaded:
            loaded[case] = load_reference(checkpoints[case])
        return loaded[case]

    return get


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One artifact cache shared by the whole run, so each fixture compiles once."""
    return tmp_path_factory.mktemp("linnet-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, session_cache):
    monkeypatch.setenv("LINNET_CACHE", str(session_cache))


@pytest.fixture(scope="session", autouse=True)
def _decode_kernels_built():
    """Linnet's CPU decode kernels built (once per environment, ~100 s) before any test, so no test's
    output carries the one-time build notice."""
    import warnings

    from linnet_core.backends.cpu import build, extension

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", build.KernelBuildNotice)
        extension.extension()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run where CUDA is present and are skipped, with the reason shown, elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
