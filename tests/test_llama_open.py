"""llama.cpp opened so that it runs on this CPU: on one with AMX its extra buffer types stay off
(ggml's AMX matmul crashed the process on q8_0 weights here), and nothing else changes."""

from __future__ import annotations

import pytest

from linnet_core.gguf import llama_open

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("amx", [True, False])
def test_extra_buffer_types_are_off_only_where_the_cpu_has_amx(monkeypatch, amx):
    import llama_cpp.llama_cpp as bindings

    seen = {}

    class FakeLlama:  # what Llama.__init__ does first: take the bindings' default model parameters
        def __init__(self, **kwargs):
            seen["kwargs"] = kwargs
            seen["extra_buffers"] = bindings.llama_model_default_params().use_extra_bufts

    monkeypatch.setattr(llama_open, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(llama_cpp, "Llama", FakeLlama)
    default = bindings.llama_model_default_params
    llama_open.open_llama(model_path="m.gguf", n_ctx=8)
    assert seen["kwargs"] == {"model_path": "m.gguf", "n_ctx": 8}
    assert seen["extra_buffers"] is (not amx)
    assert bindings.llama_model_default_params is default  # put back for everyone else
    assert default().use_extra_bufts is True


def test_the_cpu_is_read_once():
    assert llama_open.cpu_has_amx() in (True, False)
    assert llama_open.cpu_has_amx.cache_info().currsize == 1
