"""Broken copies of a correct GGUF, each broken the way deployments break, for `verify --url` to catch:
a rope base off by one part in a thousand, a chat template that drops the system message, one layer's
weights perturbed by 2% noise, a tokenizer missing one merge (one the given texts use).

    python tests/broken_servers.py MODEL_FOLDER CORRECT.gguf OUT/    # writes OUT/<variant>.gguf, prints each

Each variant names the diagnosis `verify --url` must give (EXPECTED).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf_corpus import read, write

from linnet_core.tokenizer import Tokenizer, byte_level_alphabet

EXPECTED = {"rope base": "logits", "chat template": "chat template", "one layer": "logits",
            "tokenizer merge": "tokenizer"}
PERTURBED = "blk.1.ffn_down.weight"


def drop_system(template: str) -> str:
    """A ChatML-style template that leaves the system message out."""
    broken = template.replace("{% for message in messages %}",
                              "{% for message in messages if message['role'] != 'system' %}")
    if broken == template:
        raise ValueError("the template has no `{% for message in messages %}` loop to break")
    return broken


def make(model: Path, good: Path, out: Path, texts: list[str]) -> dict[str, Path]:
    """The four variants of `good` (a float32 GGUF of `model`) under `out`, by their names in EXPECTED."""
    meta, tensors = read(good)
    arch = meta["general.architecture"][1]
    tok = Tokenizer(model)
    used = {_byte_level(tok.token_bytes(i)) for t in texts for i in tok.encode(t)}

    def variant(name: str, meta_edit=None, tensor_edit=None) -> Path:
        m = {k: (t, list(v) if isinstance(v, list) else v) for k, (t, v) in meta.items()}
        if meta_edit:
            meta_edit(m)
        path = out / f"{name}.gguf"
        write(path, m, [tensor_edit(t) for t in tensors] if tensor_edit else tensors)
        return path

    def rope(m):
        kind, base = m[f"{arch}.rope.freq_base"]
        m[f"{arch}.rope.freq_base"] = (kind, base * 1.001)

    def template(m):
        m["tokenizer.chat_template"] = (m["tokenizer.chat_template"][0], drop_system(m["tokenizer.chat_template"][1]))

    def layer(t):
        name, shape, kind, raw = t
        if name != PERTURBED:
            return t
        if kind != "F32":
            raise ValueError(f"{PERTURBED} is {kind}: perturbing it needs a float32 GGUF")
        w = np.frombuffer(raw, dtype=np.float32)
        noise = np.random.default_rng(0).standard_normal(w.shape).astype(np.float32)
        return name, shape, kind, (w * (1 + 0.02 * noise)).astype(np.float32).tobytes()

    def merge(m):
        kind, merges = m["tokenizer.ggml.merges"]
        # the first merge that makes a token of the texts (3 bytes or more): without it they split otherwise
        drop = next(mg for mg in merges if mg.replace(" ", "", 1) in used and len(mg) > 3)
        m["tokenizer.ggml.merges"] = (kind, [mg for mg in merges if mg != drop])

    out.mkdir(parents=True, exist_ok=True)
    return {"rope base": variant("rope", rope), "chat template": variant("template", template),
            "one layer": variant("layer", tensor_edit=layer), "tokenizer merge": variant("merge", merge)}


def _byte_level(raw: bytes) -> str:
    """GPT-2's byte-level spelling of `raw`, as a GGUF's merges write pieces."""
    spelled = {b: c for c, b in byte_level_alphabet().items()}
    return "".join(spelled[b] for b in raw)


if __name__ == "__main__":
    from linnet_core.check.served import DEFAULT_PROMPTS

    for name, path in make(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), list(DEFAULT_PROMPTS)).items():
        print(f"{path}\t{name}\texpected diagnosis: {EXPECTED[name]}")
