"""A fuzz corpus of hostile GGUF files, made from one good file: every metadata key Linnet reads given
the wrong type, zero, a non-finite or a huge value, removed, or at odds with another key or with the
tensors; vocabularies whose parts disagree; alignments and arrays no reader should take.

    python tests/gguf_corpus.py base.gguf out/    # writes out/<case>.gguf, prints each case and what is expected

Each case says what a user must see: `refused` (one line naming the key, in bounded time and memory)
or `runs` (the file is served as it is, by the rule docs/hardening.md states).
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linnet_core.gguf.reader import GGML_TYPES, TYPE_NAMES, read_gguf

TYPE_IDS = {name: i for i, name in TYPE_NAMES.items()}
GGML_IDS = {name: i for i, (name, _, _) in GGML_TYPES.items()}
FORMATS = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i", "f32": "<f", "bool": "<?",
           "u64": "<Q", "i64": "<q", "f64": "<d"}
ALIGN = 32
ARRAY = 9  # GGUF's value type id of an array


@dataclass
class Case:
    name: str
    change: Any  # (metadata dict, tensor list) -> None, editing them in place
    expect: str  # "refused: <text the error line holds>" or "runs"


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: str, value: Any) -> bytes:
    if kind == "string":
        return _string(value)
    if kind == "raw":  # bytes written as they are after the type id: arrays of arrays and the like
        return value
    if kind.startswith("array["):
        inner = kind[6:-1]
        head = struct.pack("<I", TYPE_IDS[inner]) + struct.pack("<Q", len(value))
        return head + b"".join(_value(inner, v) for v in value)
    return struct.pack(FORMATS[kind], value)


def write(path: Path, meta: dict[str, tuple[str, Any]], tensors: list[tuple[str, tuple[int, ...], str, bytes]]) -> None:
    """A GGUF v3 of `meta` (key -> (type name, value); type "raw" is (type id, bytes)) and `tensors`
    (name, shape outermost first, GGML type name, bytes), laid out at 32-byte alignment."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, (kind, value) in meta.items():
        type_id, payload = (value[0], value[1]) if kind == "raw" else \
            (ARRAY if kind.startswith("array[") else TYPE_IDS[kind], _value(kind, value))
        out += _string(key) + struct.pack("<I", type_id) + payload
    offset = 0
    for name, shape, gtype, raw in tensors:
        dims = tuple(reversed(shape))
        out += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", GGML_IDS[gtype], offset)
        offset += -(-len(raw) // ALIGN) * ALIGN
    out += b"\0" * (-len(out) % ALIGN)
    for _, _, _, raw in tensors:
        out += raw + b"\0" * (-len(raw) % ALIGN)
    path.write_bytes(bytes(out))


def read(path: Path) -> tuple[dict[str, tuple[str, Any]], list[tuple[str, tuple[int, ...], str, bytes]]]:
    with read_gguf(path) as g:
        meta = {k: (g.types[k], v.tolist() if isinstance(v, np.ndarray) else v) for k, v in g.metadata.items()}
        tensors = [(t.name, t.shape, t.type, bytes(g.raw(t.name))) for t in g.tensors.values()]
    return meta, tensors


def cases(meta: dict[str, tuple[str, Any]]) -> list[Case]:
    arch = meta["general.architecture"][1]
    spm = meta["tokenizer.ggml.model"][1] == "llama"

    def k(name: str) -> str:
        return f"{arch}.{name}"

    def put(key: str, kind: str, value: Any):
        return lambda m, t: m.__setitem__(key, (kind, value))

    def drop(key: str):
        return lambda m, t: m.pop(key)

    def refused(text: str) -> str:
        return f"refused: {text}"

    counts = ["embedding_length", "attention.head_count", "block_count", "feed_forward_length", "context_length"]
    out: list[Case] = []
    for name in counts:  # the wrong type, zero, huge, missing
        key = k(name)
        out += [
            Case(f"{name}-as-string", put(key, "string", "64"), refused(f"'{key}' must hold an integer")),
            Case(f"{name}-as-bool", put(key, "bool", True), refused(f"'{key}' must hold an integer")),
            Case(f"{name}-as-float", put(key, "f32", 64.0), refused(f"'{key}' must hold an integer")),
            Case(f"{name}-zero", put(key, "u32", 0), refused(f"'{key}' must hold an integer from 1")),
            Case(f"{name}-huge", put(key, "u64", 2**63 + 5), refused(f"'{key}'")),
            Case(f"{name}-negative", put(key, "i32", -4), refused(f"'{key}' must hold an integer from 1")),
            Case(f"{name}-missing", drop(key), refused(f"'{key}' is missing")),
        ]
    out += [
        Case("head_count-array-of-layers", put(k("attention.head_count"), "array[u32]", [4, 8]),
             refused("differs between layers")),
        Case("head_count-array-of-strings", put(k("attention.head_count"), "array[string]", ["4", "4"]),
             refused(f"'{k('attention.head_count')}' must hold an integer")),
        Case("head_count-kv-zero", put(k("attention.head_count_kv"), "u32", 0), refused("head_count_kv")),
        Case("head_count-kv-above-heads", put(k("attention.head_count_kv"), "u32", 64), refused("head_count_kv")),
        Case("head_count-kv-does-not-divide", put(k("attention.head_count_kv"), "u32", 3), refused("head_count_kv")),
        Case("head_count-odd-width", lambda m, t: (m.pop(k("attention.key_length"), None),
                                                   m.__setitem__(k("attention.head_count"), ("u32", 3)),
                                                   m.__setitem__(k("attention.head_count_kv"), ("u32", 3))),
             refused("does not divide the embedding width")),
        Case("head_count-against-q-rows", put(k("attention.head_count"), "u32", 8), refused("do not match")),
        Case("key_length-zero", put(k("attention.key_length"), "u32", 0), refused("key_length")),
        Case("key_length-as-string", put(k("attention.key_length"), "string", "16"), refused("key_length")),
        Case("value_length-differs", put(k("attention.value_length"), "u32", 8), refused("value heads differ")),
        Case("rope-dimension-odd", put(k("rope.dimension_count"), "u32", 3), refused("odd")),
        Case("rope-dimension-past-head", put(k("rope.dimension_count"), "u32", 4096), refused("rope.dimension_count")),
        Case("block_count-million", put(k("block_count"), "u32", 1_000_000), refused("tensors are for")),
        Case("block_count-ten-million", put(k("block_count"), "u32", 10_000_000), refused("block_count")),
        Case("block_count-below-layers", put(k("block_count"), "u32", 1), refused("tensors are for")),
        Case("feed_forward-against-tensor", put(k("feed_forward_length"), "u32", 7), refused("ffn_down")),
        Case("embedding_length-against-table", put(k("embedding_length"), "u32", 32), refused("embedding_length")),
        Case("vocab_size-against-table", put(k("vocab_size"), "u32", 5), refused("vocab_size")),
        Case("vocab_size-huge", put(k("vocab_size"), "u64", 2**40), refused("vocab_size")),
        Case("context_length-2^60", put(k("context_length"), "u64", 2**60), refused("context_length")),
        Case("eps-nan", put(k("attention.layer_norm_rms_epsilon"), "f32", float("nan")), refused("finite")),
        Case("eps-inf", put(k("attention.layer_norm_rms_epsilon"), "f64", float("inf")), refused("finite")),
        Case("eps-zero", put(k("attention.layer_norm_rms_epsilon"), "f32", 0.0), refused("finite")),
        Case("eps-as-string", put(k("attention.layer_norm_rms_epsilon"), "string", "1e-6"), refused("finite number")),
        Case("eps-as-array", put(k("attention.layer_norm_rms_epsilon"), "array[f32]", [1e-6]), refused("finite")),
        Case("eps-missing", drop(k("attention.layer_norm_rms_epsilon")), refused("is missing")),
        Case("rope-base-nan", put(k("rope.freq_base"), "f32", float("nan")), refused("rope.freq_base")),
        Case("rope-base-inf", put(k("rope.freq_base"), "f32", float("inf")), refused("rope.freq_base")),
        Case("rope-base-negative", put(k("rope.freq_base"), "f32", -10000.0), refused("rope.freq_base")),
        Case("rope-base-tiny", put(k("rope.freq_base"), "f64", 1e-300), refused("rope.freq_base")),
        Case("rope-base-as-u32", put(k("rope.freq_base"), "u32", 10000), refused("rope.freq_base")),
        Case("rope-scaling-as-int", put(k("rope.scaling.type"), "u32", 1), refused("rope.scaling.type")),
        Case("rope-scaling-unknown", put(k("rope.scaling.type"), "string", "yarn"), refused("not supported")),
        Case("rope-scaling-linear-nan", lambda m, t: (m.__setitem__(k("rope.scaling.type"), ("string", "linear")),
                                                      m.__setitem__(k("rope.scaling.factor"), ("f32", float("nan")))),
             refused("rope.scaling.factor")),
        Case("rope-scaling-linear-missing-factor", put(k("rope.scaling.type"), "string", "linear"),
             refused("rope.scaling.factor")),
        Case("sliding-window-negative", put(k("attention.sliding_window"), "i32", -8), refused("sliding_window")),
        Case("sliding-window-as-string", put(k("attention.sliding_window"), "string", "8"), refused("sliding_window")),
        Case("architecture-unknown", put("general.architecture", "string", "falcon"), refused("not supported")),
        Case("architecture-as-int", put("general.architecture", "u32", 7), refused("general.architecture")),
        Case("architecture-missing", drop("general.architecture"), refused("architecture")),
        Case("alignment-as-bool", put("general.alignment", "bool", True), refused("general.alignment")),
        Case("alignment-as-string", put("general.alignment", "string", "32"), refused("general.alignment")),
        Case("alignment-as-i32", put("general.alignment", "i32", 32), refused("general.alignment")),
        Case("alignment-zero", put("general.alignment", "u32", 0), refused("general.alignment")),
        Case("nested-empty-arrays", lambda m, t: m.__setitem__(
            "junk.nested", ("raw", (9, struct.pack("<IQ", 9, 200_000) + struct.pack("<IQ", 4, 0) * 200_000))),
            refused("array of arrays")),
        Case("unknown-keys-of-every-type", lambda m, t: m.update({
            "junk.a": ("string", "x" * 1000), "junk.b": ("array[f64]", [float("nan")] * 100),
            "junk.c": ("bool", False), "junk.d": ("array[string]", ["", "y"])}), "runs"),
        Case("head_count-kv-one-per-layer", lambda m, t: m.__setitem__(
            k("attention.head_count_kv"), ("array[i32]", [m[k("attention.head_count_kv")][1]] * m[k("block_count")][1])),
            "runs"),
        Case("general-name-as-int", put("general.name", "u32", 5), "runs"),  # a label Linnet reads only on export
    ]
    tokens = meta["tokenizer.ggml.tokens"][1]
    n = len(tokens)
    out += [
        Case("tokens-as-u32", put("tokenizer.ggml.tokens", "array[u32]", list(range(n))),
             refused("tokenizer.ggml.tokens")),
        Case("tokens-empty", put("tokenizer.ggml.tokens", "array[string]", []), refused("tokenizer.ggml.tokens")),
        Case("tokens-shorter-than-table", lambda m, t: m.update(
            {key: (m[key][0], m[key][1][:-3]) for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                          "tokenizer.ggml.scores") if key in m}),
             refused("rows of token_embd.weight")),
        Case("token-of-a-megabyte", put("tokenizer.ggml.tokens", "array[string]", tokens[:-1] + ["a" * (1 << 20)]),
             refused("holds a token of 1048576 characters")),
        Case("tokens-duplicated", put("tokenizer.ggml.tokens", "array[string]", tokens[:-1] + tokens[-2:-1]), "runs"),
        Case("token-types-short", put("tokenizer.ggml.token_type", "array[i32]", [1] * (n - 1)),
             refused("tokenizer.ggml.token_type")),
        Case("token-types-unknown", put("tokenizer.ggml.token_type", "array[i32]", [99] * n),
             refused("tokenizer.ggml.token_type")),
        Case("token-types-as-strings", put("tokenizer.ggml.token_type", "array[string]", ["1"] * n),
             refused("tokenizer.ggml.token_type")),
        Case("every-token-a-control-token", put("tokenizer.ggml.token_type", "array[i32]", [3] * n), "runs"),
        Case("model-unknown", put("tokenizer.ggml.model", "string", "bert"), refused("tokenizer type 'bert'")),
        Case("model-as-int", put("tokenizer.ggml.model", "u8", 1), refused("tokenizer.ggml.model")),
        Case("model-missing", drop("tokenizer.ggml.model"), refused("tokenizer.ggml.model")),
        Case("bos-out-of-range", put("tokenizer.ggml.bos_token_id", "u32", n + 10), refused("bos_token_id")),
        Case("bos-as-string", put("tokenizer.ggml.bos_token_id", "string", "1"), refused("bos_token_id")),
        Case("eos-negative", put("tokenizer.ggml.eos_token_id", "i32", -1), refused("eos_token_id")),
        Case("add-bos-as-u32", put("tokenizer.ggml.add_bos_token", "u32", 1), refused("add_bos_token")),
        Case("chat-template-as-int", put("tokenizer.chat_template", "u32", 1), refused("chat_template")),
        Case("control-token-empty", lambda m, t: (
            m.__setitem__("tokenizer.ggml.tokens", ("array[string]", tokens[:-1] + [""])),
            m.__setitem__("tokenizer.ggml.token_type", ("array[i32]", m["tokenizer.ggml.token_type"][1][:-1] + [3]))),
             "runs"),
    ]
    if spm:
        out += [
            Case("scores-short", put("tokenizer.ggml.scores", "array[f32]", [0.0] * (n - 2)),
                 refused("tokenizer.ggml.scores")),
            Case("scores-nan", put("tokenizer.ggml.scores", "array[f32]", [float("nan")] * n),
                 refused("tokenizer.ggml.scores")),
            Case("unknown-id-out-of-range", put("tokenizer.ggml.unknown_token_id", "u32", n), refused("unknown_token_id")),
        ]
    else:
        merges = meta["tokenizer.ggml.merges"][1]
        out += [
            Case("merge-of-unknown-pieces", put("tokenizer.ggml.merges", "array[string]", ["zzqq yyxx", *merges]),
                 refused("tokenizer.ggml.merges")),
            Case("merge-without-space", put("tokenizer.ggml.merges", "array[string]", [merges[0].replace(" ", "")]),
                 refused("tokenizer.ggml.merges")),
            Case("merges-as-u32", put("tokenizer.ggml.merges", "array[u32]", [1, 2]), refused("tokenizer.ggml.merges")),
            Case("pre-unknown", put("tokenizer.ggml.pre", "string", "made-up"), refused("pre-tokenizer 'made-up'")),
            Case("pre-as-int", put("tokenizer.ggml.pre", "u32", 3), refused("tokenizer.ggml.pre")),
        ]
    return out


def make(base: Path, out: Path) -> dict[str, tuple[Path, str]]:
    """Every case of `base` written under `out`: name -> (file, what is expected)."""
    out.mkdir(parents=True, exist_ok=True)
    meta, tensors = read(base)
    made = {}
    for case in cases(meta):
        m, t = dict(meta), list(tensors)
        case.change(m, t)
        path = out / f"{case.name}.gguf"
        write(path, m, t)
        made[case.name] = (path, case.expect)
    return made


if __name__ == "__main__":
    for name, (path, expect) in make(Path(sys.argv[1]), Path(sys.argv[2])).items():
        print(f"{name}\t{expect}\t{path}")
