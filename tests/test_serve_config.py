"""One serving configuration for every face: `linnet serve`'s options, Triton's config.pbtxt parameters
and the serving bench build the same ServeConfig, validated in one place, and the engine takes it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from test_cli import assert_one_line_error, invoke

from linnet_core.compile import load_model
from linnet_core.errors import InputError
from linnet_core.serve.config import ServeConfig
from linnet_core.serve.engine import Engine

PARAMETER = re.compile(r'\{ key: ("(?:[^"\\]|\\.)*"), value: \{ string_value: ("(?:[^"\\]|\\.)*") \} \}')


def pbtxt_parameters(text: str) -> dict[str, str]:
    return {json.loads(k): json.loads(v) for k, v in PARAMETER.findall(text)}


def test_every_field_survives_a_triton_config_and_bad_ones_name_the_parameter():
    config = ServeConfig(model="/m", backend="onnxruntime", dtype="q8_0", rows=3, cache_len=80, prefill_chunk=16,
                         max_waiting=9, decode_stall=0, burst_wait_ms=0, prefix_caching=False)
    assert ServeConfig.from_parameters(config.to_parameters()) == config
    assert ServeConfig.from_parameters({"linnet_model": "/m", "EXECUTION_ENV_PATH": "/env"}) == ServeConfig(model="/m")
    for params, says in (({"linnet_rows": "eight"}, "'linnet_rows' must be an integer"),
                         ({"linnet_rowz": "8"}, "unknown parameter 'linnet_rowz'"),
                         ({"linnet_decode_stall": "0.5"}, "'linnet_decode_stall' is 0 (off) or at least 1"),
                         ({"linnet_prefix_caching": "maybe"}, "'linnet_prefix_caching' must be true or false"),
                         ({"linnet_burst_wait_ms": "nan"}, "'linnet_burst_wait_ms' must be 0 to 60000")):
        with pytest.raises(InputError, match=re.escape(says)):
            ServeConfig.from_parameters(params)


@pytest.mark.parametrize("field,value,says", [("rows", 0, "--rows"), ("prefill_chunk", True, "--prefill-chunk"),
                                              ("decode_stall", float("inf"), "--decode-stall"),
                                              ("burst_wait_ms", -1, "--burst-wait"), ("cache_len", 0, "--cache-len")])
def test_a_bad_value_is_refused_by_its_option_name(field, value, says):
    with pytest.raises(InputError, match=re.escape(says)):
        ServeConfig(**{field: value})


def test_the_engine_takes_the_configuration(tokenized_checkpoints):
    session, _ = load_model(tokenized_checkpoints["qwen2-bias-tied"], "torch", "float32", 64, rows=2)
    engine = Engine.from_config(session, None, ServeConfig(prefill_chunk=12, max_waiting=3, decode_stall=0,
                                                           burst_wait_ms=10, prefix_caching=False))
    assert (engine.prefill_chunk, engine.max_waiting, engine.prefix, engine.burst_wait) == (12, 3, None, (0.01, 0.025))
    assert engine.budget.stall is None
    default = Engine.from_config(session, None, ServeConfig())
    plain = Engine(session, None)
    assert (default.prefill_chunk, default.max_waiting, default.burst_wait, default.budget.stall) == \
        (plain.prefill_chunk, plain.max_waiting, plain.burst_wait, plain.budget.stall)


def test_export_triton_writes_every_engine_option(tokenized_checkpoints, tmp_path):
    """A Triton user sets what a `linnet serve` user sets: the options here, config.pbtxt later; a
    model path with quotes and accents is written as text format reads it."""
    model = tmp_path / 'my "model" café'
    shutil.copytree(tokenized_checkpoints["qwen2-bias-tied"], model)
    out = tmp_path / "repo"
    r = invoke("export", "triton", model, out, "--rows", "3", "--cache-len", "64",
               "--prefill-chunk", "32", "--max-waiting", "7", "--decode-stall", "0", "--burst-wait", "5",
               "--no-prefix-caching", "--name", "m")
    assert r.exit_code == 0, r.stderr
    config = ServeConfig.from_parameters(pbtxt_parameters((out / "m" / "config.pbtxt").read_text()))
    assert config == ServeConfig(model=str(model.resolve()), dtype="float32",
                                 rows=3, cache_len=64, prefill_chunk=32, max_waiting=7, decode_stall=0,
                                 burst_wait_ms=5, prefix_caching=False)


def test_serve_refuses_a_bad_option_in_one_line_before_loading(tmp_path):
    r = invoke("serve", str(tmp_path / "no-such-model"), "--decode-stall", "0.5")
    assert_one_line_error(r, contains="--decode-stall is 0 (off) or at least 1")
