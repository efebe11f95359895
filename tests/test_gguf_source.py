"""A GGUF file as the model: the spec, weights and tokenizer read back from it match the checkpoint
it was exported from, and every command takes `model.gguf` where it takes a folder."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from family_fixtures import FAMILY_CASES, needs_kernels
from test_cli import assert_one_line_error, invoke

pytest.importorskip("gguf")

from linnet_core.compile import load_model, open_model  # noqa: E402
from linnet_core.export.gguf_export import export_gguf, gguf_context_length  # noqa: E402
from linnet_core.models import gguf_layout  # noqa: E402
from linnet_core.gguf.reader import read_gguf  # noqa: E402
from linnet_core.check.roundtrip import SAMPLE_TEXT  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402

PROMPT = [3, 17, 5, 42, 11, 7, 29, 13]
NEW = 6


@pytest.fixture(scope="module")
def exported(tokenized_checkpoints, tmp_path_factory):
    """gguf(case, dtype): the fixture exported by Linnet (unchecked: the checks live in test_export_gguf)."""
    root = tmp_path_factory.mktemp("gguf-source")
    made = {}

    def get(case: str, dtype: str = "f32"):
        if (case, dtype) not in made:
            out = root / f"{case}-{dtype}.gguf"
            made[case, dtype] = export_gguf(tokenized_checkpoints[case], out, dtype, check=False).out
        return made[case, dtype]

    return get


def greedy(model, dtype: str, backend: str = "torch") -> tuple[list[int], np.ndarray]:
    """Greedy tokens after PROMPT and the prompt's last logits."""
    session, _ = load_model(model, backend, dtype, cache_len=32)
    out = session.prefill(PROMPT, logits="last")
    tokens = [out.tokens[0]]
    for i in range(NEW - 1):
        tokens.append(session.decode([tokens[-1]], [len(PROMPT) + i], [0]).tokens[0])
    return tokens, np.asarray(out.logits, dtype=np.float32).reshape(-1)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_spec_read_from_a_gguf_is_the_checkpoints(case, exported, tokenized_checkpoints):
    src, got = open_model(tokenized_checkpoints[case]).spec, open_model(exported(case)).spec
    assert got.family == src.family and got.dtype == "float32"
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "rope", "tie_word_embeddings", "qk_norm", "qkv_bias", "o_bias", "mlp_bias", "qk_norm_over",
            "no_rope_layers", "sliding_rope", "norm_weight_offset", "hidden_act")
    assert {k: getattr(got, k) for k in same} == {k: getattr(src, k) for k in same}
    numbers = ("rms_norm_eps", "embedding_scale", "residual_scale", "attention_scale", "logit_scale",
               "attention_softcap", "logit_softcap")  # float32 keys: within float32's rounding
    assert {k: getattr(got, k) for k in numbers} == {k: pytest.approx(getattr(src, k)) for k in numbers}
    # A GGUF declares a sliding window's length as its context where llama.cpp would attend past it
    # (see export.gguf_context_length); Gemma's sliding layers it knows, and keeps per layer.
    assert got.max_position_embeddings == gguf_context_length(src)
    assert got.layer_windows == src.layer_windows or not gguf_layout(src).sliding_every


@pytest.mark.parametrize("case", FAMILY_CASES + ["llama-llama3-rope"])  # the last: rope by a rope_freqs tensor
def test_a_float32_gguf_decodes_as_its_checkpoint(case, exported, tokenized_checkpoints):
    want_tokens, want_logits = greedy(tokenized_checkpoints[case], "float32")
    got_tokens, got_logits = greedy(exported(case), "float32")
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantized_blocks_are_kept_byte_for_byte(fmt, exported, tokenized_checkpoints):
    """A q8_0 / q4_0 GGUF compiled in its own format computes on its bytes, unchanged: the same
    steps as the checkpoint quantized by Linnet (identical weights), the q/k rows put back in order."""
    case = "llama-gqa-untied"  # llama's q/k rows are permuted in the file
    gguf_model = open_model(exported(case, fmt))
    assert gguf_model.spec.dtype == fmt
    ckpt = gguf_model.checkpoint()
    name = "model.layers.0.self_attn.q_proj.weight"
    with read_gguf(exported(case, fmt)) as g:
        assert g.tensors["blk.0.attn_q.weight"].type == fmt.upper()
    from linnet_core.quant import quantize
    from linnet_core.weights import Checkpoint

    source = Checkpoint.from_folder(tokenized_checkpoints[case]).get(name).float()
    assert torch.equal(ckpt.blocks(name, fmt), quantize(source, fmt))  # the file's bytes, rows back in order
    assert ckpt.blocks(name, "q8_0" if fmt == "q4_0" else "q4_0") is None
    (got, got_logits), (want, want_logits) = greedy(exported(case, fmt), fmt), greedy(tokenized_checkpoints[case], fmt)
    assert got == want
    np.testing.assert_array_equal(got_logits, want_logits)  # identical weights, identical kernels


def test_a_float16_gguf_computes_in_its_own_dtype(exported, tokenized_checkpoints):
    case = "qwen3-headdim128"
    assert open_model(exported(case, "f16")).spec.dtype == "float16"
    assert greedy(exported(case, "f16"), "auto")[0] == greedy(tokenized_checkpoints[case], "float16")[0]


@pytest.mark.parametrize("case", FAMILY_CASES + ["llama-llama3-rope"])  # the last: Llama 3's byte-level BPE
def test_the_tokenizer_read_from_a_gguf_encodes_as_the_checkpoints(case, exported, tokenized_checkpoints):
    src, got = Tokenizer(tokenized_checkpoints[case]), Tokenizer(exported(case))
    for text in (SAMPLE_TEXT, "  two leading spaces", "digits 1234567 and\nnewlines\n\n", ""):
        assert got.encode(text) == src.encode(text), text
        assert got.encode(text, add_special_tokens=False) == src.encode(text, add_special_tokens=False), text
        assert got.decode(got.encode(text)) == src.decode(src.encode(text))
    assert (got.bos_token, got.eos_token) == (src.bos_token, src.eos_token)
    assert got.eos_ids == src.eos_ids
    assert got.chat_template == src.chat_template


# Pieces of the tokenizer parity sweep: scripts, combining marks, emoji sequences, whitespace runs,
# digit groups, contractions, code, and every style's special tokens (whole, and a broken one).
PARITY_PIECES = [
    "Hello world", "naïve café", "日本語のテキスト", "Ελληνικά", "emoji 🤖🎉", "مرحبا بالعالم", "e\u0301", "👨‍👩‍👧",
    " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "   \n\n  ", " \t ", "1", "12", "123", "1234", "12345678",
    "3.14159", "1,000,000", "٣٤٥", "DON'T", "it's", "we'll", "def f(x):\n    return x**2", "!!!", "...", "a-b_c",
    "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|im_", "x",
    "The list object", "\u00a0", "\u3000", "ÿ", "\x00", "tab\there",
]
PARITY_TEXTS = PARITY_PIECES + [a + b for a in PARITY_PIECES[:24] for b in PARITY_PIECES[8:32]]  # 623 strings


@pytest.mark.parametrize("case", ["llama-gqa-untied", "phi3-fused-window", "qwen2-bias-tied", "llama-llama3-rope"])
def test_the_tokenizer_read_from_a_gguf_encodes_as_llama_cpp_does(case, exported):
    """llama.cpp's own tokenizer on the same file (SentencePiece-style, Qwen2's and Llama 3's byte-level
    BPE): the same ids for every sweep string, with and without BOS, special tokens parsed; decoding
    gives llama.cpp's text but for two conventions Linnet shares with transformers (special tokens
    skipped, a SentencePiece vocabulary's prefix space dropped)."""
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama

    from linnet_core.gguf.llamacpp_reference import native_stderr_kept

    mine = Tokenizer(exported(case))
    with native_stderr_kept():
        llm = Llama(model_path=str(exported(case)), vocab_only=True, verbose=False)
    with read_gguf(exported(case)) as g:
        spm = g.metadata["tokenizer.ggml.model"] == "llama"
    assert len(PARITY_TEXTS) >= 600
    for text in PARITY_TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert mine.encode(text, add_special_tokens=False) == ids, text
        assert mine.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
        said = llm.detokenize(ids, special=False).decode("utf-8", "replace")
        assert mine.decode(ids) == (said[1:] if spm and said.startswith(" ") else said), text


def test_run_and_compile_take_a_gguf(exported, tokenized_checkpoints):
    case = "qwen2-bias-tied"
    args = ("--prompt", "Hello world", "--max-new-tokens", "5", "--temperature", "0", "--json")
    want = invoke("run", tokenized_checkpoints[case], *args)
    got = invoke("run", exported(case), *args)
    assert want.exit_code == 0 and got.exit_code == 0, got.output
    want, got = json.loads(want.stdout), json.loads(got.stdout)
    assert (got["tokens"], got["text"], got["prompt_tokens"]) == (want["tokens"], want["text"], want["prompt_tokens"])
    assert invoke("compile", exported(case), "--backend", "torch", "--dtype", "float32").exit_code == 0


def test_a_bad_gguf_is_one_line(tmp_path, exported):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(exported("qwen3-headdim128").read_bytes()[:4096])
    assert_one_line_error(invoke("compile", truncated), 1, "cut.gguf")
    other = tmp_path / "other.txt"
    other.write_text("not a model")
    assert_one_line_error(invoke("compile", other), 1, "is a file")


def test_an_architecture_linnet_lacks_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(invoke("compile", path), 1, "GGUF architecture 'falcon' is not supported")


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed")


@needs_llama_cpp
@pytest.mark.parametrize("case,fmt", [("qwen3-headdim128", "f32"), ("llama-gqa-untied", "f32"),
                                      ("phi3-fused-window", "f32"),
                                      pytest.param("llama-gqa-untied", "q8_0", marks=needs_kernels)])
def test_verify_of_a_gguf_takes_llama_cpp_on_the_file_as_its_reference(case, fmt, exported):
    from linnet_core.check.verify import verify

    dtype = {"f32": "float32", "q8_0": "q8_0"}[fmt]
    report = verify(exported(case, fmt), "torch", dtype, steps=4, prompt="Hi")  # phi3-fused-window: 8 positions
    assert report.reference_dtype.startswith("llama.cpp")
    assert report.passed and report.tokens_match, (report.distance, report.tolerance)


def test_llama3_rope_scaling_is_read_from_the_rope_freqs_tensor(exported, tokenized_checkpoints, tmp_path):
    """llama.cpp carries llama3 scaling as per-frequency divisors: read back as such (the frequencies
    the checkpoint's llama3 settings give, within float32), written again by `export gguf`, and
    refused in one line by `export hf`, whose config has no spelling for them."""
    from linnet_core.export.gguf_export import rope_freq_factors
    from linnet_core.ir.rope import inv_freq

    case = "llama-llama3-rope"
    src, got = open_model(tokenized_checkpoints[case]).spec, open_model(exported(case)).spec
    assert src.rope.type == "llama3" and got.rope.type == "freq_factors"
    np.testing.assert_allclose(got.rope.freq_factors, rope_freq_factors(src), rtol=1e-7)
    np.testing.assert_allclose(inv_freq(vars(got.rope), got.rotary_dim), inv_freq(vars(src.rope), src.rotary_dim),
                               rtol=1e-6)
    again = tmp_path / "again.gguf"
    assert invoke("export", "gguf", exported(case), again, "--dtype", "f32", "--no-check").exit_code == 0
    with read_gguf(again) as g:
        np.testing.assert_array_equal(g.tensor("rope_freqs.weight"), rope_freq_factors(src))
    assert_one_line_error(invoke("export", "hf", exported(case), tmp_path / "hf"), 1, "rope_freqs")
    assert not (tmp_path / "hf").exists()
    if importlib.util.find_spec("llama_cpp") is not None:
        from linnet_core.check.verify import verify

        report = verify(exported(case), "torch", "float32", steps=4, prompt="Hi")
        assert report.passed and report.tokens_match, (report.distance, report.tolerance)


def written_by_the_gguf_package(src, dst, qtype: str):
    """`src` (a float32 GGUF) written again by the gguf package alone, none of Linnet's writer: every
    field copied, each weight matrix (and 3-d expert stack) converted or quantized by gguf.quants to
    `qtype`; 1-D tensors (norms, biases, rope factors) and a router (ffn_gate_inp) kept float32 as
    llama.cpp's converter keeps them."""
    import gguf

    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if data.ndim >= 2 and not t.name.endswith("ffn_gate_inp.weight"):
            data = gguf.quants.quantize(data, Q[qtype])
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=Q[qtype])
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@needs_llama_cpp
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", pytest.param("Q8_0", marks=needs_kernels), "Q4_0"])
def test_ggufs_the_gguf_package_writes_compute_as_llama_cpp(qtype, exported, tmp_path):
    """Not only Linnet's own writer: every family's GGUF converted and quantized by the gguf package
    alone reads back to the same spec and computes as llama.cpp does on the file (verify passes;
    Q8_0 and Q4_0 kept as the file's blocks)."""
    from linnet_core.check.verify import verify

    for case in FAMILY_CASES:
        path = written_by_the_gguf_package(exported(case), tmp_path / f"{case}-{qtype}.gguf", qtype)
        spec, f32 = open_model(path).spec, open_model(exported(case)).spec
        assert spec.dtype == {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(qtype, qtype.lower())
        assert spec.to_json() | {"dtype": None} == f32.to_json() | {"dtype": None}
        report = verify(path, "torch", "auto", steps=4, prompt="Hi")
        assert report.passed, (case, report.distance, report.tolerance)
        # A random fixture's logits sit near ties, which int8 activations may break either way: at 4 bits
        # any step; at 8 bits a step where the logits agree as a whole (smollm3's 4th layer leaves a last
        # step whose top two logits in llama.cpp differ by 0.04, 1% of their scale). A router's top-k is
        # such a tie too: 16-bit activations may take another expert (mixtral's BF16: distance 0.07
        # against a tolerance of 0.55, tokens identical when computed in float32).
        near_tie = qtype == "Q8_0" or (spec.num_experts and qtype != "F32")
        assert (report.tokens_match or qtype == "Q4_0"
                or (near_tie and report.distance <= report.tolerance / 2)), (case, repr(report))


@needs_llama_cpp
def test_verify_cli_on_a_gguf(exported):
    r = invoke("verify", exported("qwen2-bias-tied"), "--backend", "torch", "--dtype", "float32", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["passed"]


@needs_llama_cpp
def test_a_multimodal_checkpoints_language_model_runs_and_exports(tmp_path):
    """gemma-3-4b-it's layout (text_config, tensors under language_model., a vision tower): its language
    model verifies against transformers' Gemma3ForConditionalGeneration, and exports as a text model to
    Hugging Face (transformers checks it) and to GGUF (llama.cpp checks it)."""
    from family_fixtures import TOKENIZED_VOCAB, make_multimodal_gemma3
    from tokenizer_fixtures import write_tokenizer

    from linnet_core.check.verify import verify
    from linnet_core.export.hf_export import export_hf

    src = make_multimodal_gemma3(tmp_path / "mm", TOKENIZED_VOCAB)
    write_tokenizer(src, "spm", TOKENIZED_VOCAB)
    spec = open_model(src).spec
    assert (spec.model_type, spec.weight_prefix) == ("gemma3_text", "language_model.")
    assert spec.layer_windows == (8,) * 5 + (None,)
    r = verify(src, "torch", "float32", steps=8)
    assert r.passed and r.distance <= 1e-4 and r.tokens_match, r
    hf = export_hf(src, tmp_path / "hf")
    assert hf.check.passed
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "vision_config" not in config
    assert export_gguf(src, tmp_path / "m.gguf", "f32", consumer="llama.cpp").check.passed


@needs_llama_cpp
@pytest.mark.parametrize("case", ["gemma2-softcaps", "gemma3-local-global", "smollm3-nope"])
def test_what_llama_cpp_fixes_per_layer_agrees_past_the_window(case, exported):
    """Gemma's sliding layers (window 8) and Gemma 3's rope for them, SmolLM3's NoPE layer: llama.cpp
    fixes these by architecture, so Linnet on the file and llama.cpp on it agree over a prompt well
    past the window, and the file declares the model's whole context."""
    from linnet_core.check.verify import verify

    with read_gguf(exported(case)) as g:
        arch = g.metadata["general.architecture"]
        assert g.metadata[f"{arch}.context_length"] == 256
    r = verify(exported(case), "torch", "float32", steps=8, prompt=SAMPLE_TEXT)
    assert r.passed and r.prompt_tokens > 24 and r.tokens_match, r


@needs_llama_cpp
@pytest.mark.parametrize("case", ["qwen2-bias-tied", "llama-gqa-untied", "granite-multipliers", "olmo2-post-norms",
                                  "smollm3-nope", "gemma2-softcaps", "gemma3-local-global", "qwen3moe-experts",
                                  "mixtral-experts"])
def test_export_hf_from_a_gguf_is_the_checkpoint_again(case, exported, tokenized_checkpoints, tmp_path):
    """GGUF -> Hugging Face: checked in transformers against llama.cpp on the file, and it decodes
    as the checkpoint the GGUF was made from (the q/k rows back in rotate-half order)."""
    from linnet_core.export.hf_export import export_hf

    result = export_hf(exported(case), tmp_path / "hf")
    assert result.check.passed and result.check.tokenizer_match is not False
    assert greedy(tmp_path / "hf", "float32")[0] == greedy(tokenized_checkpoints[case], "float32")[0]
    assert_one_line_error(invoke("export", "hf", exported(case, "q8_0"), tmp_path / "q"), 1, "float weights")


@needs_llama_cpp
@needs_kernels
@pytest.mark.slow
def test_bench_of_a_gguf_puts_linnet_beside_llama_cpp_on_the_file(exported):
    """llama.cpp runs the very file; transformers, the reference, loads Linnet's export of it."""
    fast = ["--prompt-tokens", "16", "--new-tokens", "4", "--runs", "1", "--warmups", "0"]
    r = invoke("bench", exported("qwen3-headdim128", "q8_0"), "--backend", "torch", "--compare", "llama.cpp", *fast,
               "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    sides = {s["key"]: s for s in data["sides"]}
    assert data["dtype"] == "q8_0"
    assert {k: sides[k]["status"] for k in ("transformers", "linnet:torch", "llama.cpp")} == dict.fromkeys(
        ("transformers", "linnet:torch", "llama.cpp"), "ok")
    assert sides["llama.cpp"]["label"] == "llama.cpp on the file"
    # Both engines round activations to int8 blocks over the very same weights; the reference does not:
    # a few int8 quanta each at this model's logit scale (verify's int8 bound is 5e-2 x max |logit|).
    assert sides["linnet:torch"]["distance"] < 0.2 and sides["llama.cpp"]["distance"] < 0.2, sides
    r = invoke("bench", exported("qwen3-headdim128", "q8_0"), "--dtype", "float32", "--backend", "torch",
               "--compare", "llama.cpp", *fast, "--json")
    assert r.exit_code == 0
    llama = {s["key"]: s for s in json.loads(r.stdout)["sides"]}["llama.cpp"]
    assert llama["status"] != "ok" and "--dtype q8_0" in llama["reason"]


@needs_llama_cpp
@pytest.mark.parametrize("case,source_fmt,dtype", [("qwen3-headdim128", "f32", "f16"),
                                                   pytest.param("llama-gqa-untied", "q8_0", "q4_0", marks=needs_kernels)])
def test_a_gguf_exported_again_in_another_format_loads_in_llama_cpp(case, source_fmt, dtype, exported, tmp_path):
    """q8_0 -> q4_0 (and f32 -> f16): the vocabulary and tokenizer keys go across as they are,
    checked in llama.cpp against llama.cpp on the source file."""
    source = exported(case, source_fmt)
    result = export_gguf(source, tmp_path / f"again-{dtype}.gguf", dtype, consumer="llama.cpp")
    assert result.check.passed and result.check.tokenizer_match, result.check.describe()
    with read_gguf(source) as a, read_gguf(result.out) as b:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id"):
            assert np.array_equal(np.asarray(a.metadata.get(key)), np.asarray(b.metadata.get(key))), key


@needs_llama_cpp
@pytest.mark.parametrize("ftype,kinds", [("Q4_K_M", {"Q4_K", "Q6_K"}), ("Q5_K_M", {"Q5_K", "Q6_K"})])
@pytest.mark.parametrize("case_id", FAMILY_CASES)
def test_k_quant_files_from_llama_cpps_quantizer_compute_as_llama_cpp(case_id, ftype, kinds, tmp_path):
    """The K-quants people download (a Q4_K_M mixes Q4_K and Q6_K, a Q5_K_M Q5_K and Q6_K), written
    by llama.cpp's own quantizer for every family, dequantized on the way in: verify against
    llama.cpp on the file passes."""
    import ctypes

    import llama_cpp
    from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint
    from tokenizer_fixtures import write_tokenizer

    from linnet_core.gguf.llamacpp_reference import native_stderr_kept
    from linnet_core.check.verify import verify
    from linnet_core.weights import Checkpoint

    case = next(c for c in CASES if c.id == case_id)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # every row a multiple of 256
    if "query_pre_attn_scalar" in case.kwargs:  # llama.cpp scales scores by 1/sqrt(head_dim)
        heads["query_pre_attn_scalar"] = 64
    folder = make_checkpoint(case, tmp_path / "k", vocab_size=TOKENIZED_VOCAB, hidden_size=256,
                             intermediate_size=512, **{**heads, **({"num_key_value_heads": 4} if "phi3" in case_id
                                                                   else {})})
    write_tokenizer(folder, case.tokenizer, TOKENIZED_VOCAB)
    f32 = export_gguf(folder, tmp_path / "f32.gguf", "f32", check=False).out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), 2
    with native_stderr_kept():
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp_path / "q.gguf").encode(),
                                              ctypes.byref(params)) == 0
    with read_gguf(tmp_path / "q.gguf") as g:
        assert kinds <= {t.type for t in g.tensors.values()}
    model = open_model(tmp_path / "q.gguf")
    assert model.spec.dtype == "bfloat16"  # auto: K-quants compute in 16 bits
    source = Checkpoint.from_folder(folder)
    # a projection of queries (llama: rows permuted in the file) or Phi-3's fused q/k/v
    name = next(n for n in source.tensors
                if n.endswith(("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.qkv_proj.weight")))
    want = source.get(name).float()
    assert (model.checkpoint().get(name) - want).abs().max() <= 0.1 * want.abs().max()  # 4 bits: ~1/15 of the range
    report = verify(tmp_path / "q.gguf", "torch", "float32", steps=4, prompt="Hi")
    assert report.passed, (report.distance, report.tolerance)


def test_compiling_a_gguf_in_another_format_says_so_in_one_line(exported):
    r = invoke("compile", exported("qwen3-headdim128", "q8_0"), "--backend", "torch", "--dtype", "float32")
    assert r.exit_code == 0, r.stderr
    assert "the GGUF's Q8_0 weights are converted to float32 (its own format: --dtype q8_0)" in r.stderr
    r = invoke("compile", exported("qwen3-headdim128", "q8_0"), "--backend", "torch")
    assert r.exit_code == 0 and "converted" not in r.stderr


@pytest.mark.slow
def test_serve_takes_a_gguf_and_answers_as_the_checkpoint(exported, tokenized_checkpoints):
    """`linnet serve x.gguf`: the chat template and tokenizer come from the file, the reply is the
    checkpoint's own greedy reply."""
    httpx = pytest.importorskip("httpx")
    from linnet_core.bench.serving.targets import start_server
    from linnet_core.serve.config import ServeConfig
    from linnet_core.runtime.generate import Generation

    case = "qwen2-bias-tied"
    proc, url = start_server(str(exported(case)), ServeConfig(dtype="float32", rows=2, cache_len=64))
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    finally:
        proc.kill()
        proc.wait()
    assert r.status_code == 200, r.text
    tok = Tokenizer(tokenized_checkpoints[case])
    session, _ = load_model(tokenized_checkpoints[case], "torch", "float32", cache_len=64)
    want = tok.decode(list(Generation(session, tok.apply_chat_template([{"role": "user", "content": "Hello"}]), 6)))
    assert r.json()["choices"][0]["message"]["content"] == want
