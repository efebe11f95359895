"""verify --url: a running server, whoever built it, against the reference on the same tokens.

For each prompt the server is asked for a greedy continuation with logprobs (and, where it gives
them, the prompt's: `echo`, vLLM's `prompt_logprobs`); the reference (transformers on a checkpoint
folder, llama.cpp on a GGUF) is run teacher-forced over the server's own tokens, so every position
compares two distributions over the same context. Per prompt: greedy agreement up to the first
divergence, max |Δ logprob| of the chosen tokens and of the listed alternatives, top-k overlap and
the KL divergence over the server's top-k (plus the rest as one outcome). The tokenizer (the
server's `/tokenize`, else the prompt counts in `usage`) and the chat template (the server's
rendering of a conversation against the model's own) are checked on their own, so a failure names
where it is: tokenizer, chat template or logits.
"""

from __future__ import annotations

import gc
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..bench.machine import environment
from ..compile import Model, open_model, pick_dtype
from ..dtypes import FORMATS
from ..errors import InputError
from ..gguf.llamacpp_reference import llamacpp, llamacpp_activations, native_stderr_kept
from ..tokenizer import Tokenizer
from .agreement import TOLERANCE, log_softmax
from .prompts import DEFAULT_PROMPT, UNSEEN_TEXT, has_tokenizer
from .reference import as_quantized, load_reference, reference_dtype, run_reference
from .served_ask import Asked, Asker
from .served_compare import Bounds, Comparison, compare, compare_text
from .server_api import Client, Refused, ServerFailed

# Prompts that exercise the tokenizer (digits, code, accents, CJK, emoji) and, the last, positions
# far enough out that a wrong rope base shows.
DEFAULT_PROMPTS = (
    DEFAULT_PROMPT,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "print([fib(i) for i in range(10)])  # 0, 1, 1, 2,",
    "Ça coûte 12,50 € — naïve café, Straße, 東京 and 🙂; in 1984, 3.14159 × 42 =",
    UNSEEN_TEXT.read_text()[:640].rsplit(" ", 1)[0],
)
CHAT = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "What does a tokenizer do?"}]


@dataclass
class ServedReport:
    model: str
    url: str
    served_model: str
    dtype: str
    reference: str
    tolerance: float  # on |Δ logprob|
    kld_bound: float
    top_logprobs: int
    tokenizer: dict  # {"checked": how or None, "passed": bool, "findings": [...]}
    template: dict  # {"checked": how or None, "passed": bool, "finding": str | None}
    comparisons: list[Comparison]
    capabilities: dict
    missing: list[str]
    diagnosis: list[str]  # where it is wrong: tokenizer, chat template, logits
    passed: bool
    environment: dict
    seconds: float = 0.0
    baseline: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


class Reference:
    """The reference's logits over any token sequence, the model loaded once for every prompt."""

    def __init__(self, m: Model, dtype: str):
        self.m, self.dtype = m, dtype
        self._llm = self._hf = None
        # the precision it computes in: llama.cpp rounds as the file's weights say (a rounding of its own)
        self.label = f"llama.cpp ({m.config.get('gguf_weights', 'F32')} weights)" if m.is_gguf else "float32"

    @contextmanager
    def opened(self, positions: int):
        if self.m.is_gguf:
            with llamacpp(self.m.path, positions) as llm:
                self._llm = llm
                yield self
            self._llm = None
            return
        fmt = FORMATS[self.dtype]
        self.label = reference_dtype(self.m.spec, self.dtype)
        self._hf = load_reference(self.m.path, self.label)
        if fmt.quantized:  # the reference over the very blocks a server of this format computes on
            as_quantized(self._hf, self.m.spec, self.dtype, "int8")
        try:
            yield self
        finally:
            self._hf = None
            gc.collect()

    def describe(self) -> str:
        if self.m.is_gguf:
            return f"{self.label} on {self.m.path.name}"
        quantized = f" over {self.dtype}'s dequantized blocks" if FORMATS[self.dtype].quantized else ""
        return f"transformers eager, {self.label}{quantized}"

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """The reference's own n greedy tokens after `ids`, and the logits each was picked from [n, V]."""
        tokens, rows = [], []
        for _ in range(n):
            rows.append(self.logits(list(ids) + tokens)[-1])
            tokens.append(int(rows[-1].argmax()))
        return tokens, np.stack(rows)

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), V]: position t predicts ids[t + 1]."""
        if self._llm is not None:
            with native_stderr_kept():
                self._llm.reset()
                self._llm.eval(list(ids))
                return np.array(self._llm.scores[:len(ids)], dtype=np.float32)
        return run_reference(self._hf, list(ids), 0).logits


def activations_of(dtype: str) -> str:
    """What the claimed dtype rounds activations to, the key of its tolerance."""
    return "int8" if FORMATS[dtype].quantized else dtype


def read_prompts(path: Path | None) -> list[dict]:
    """The default prompts, then a file's: one text per line, or JSON lines of {"prompt"} or {"messages"}."""
    items = [{"prompt": p} for p in DEFAULT_PROMPTS] + [{"messages": CHAT}]
    if path is None:
        return items
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path}: cannot be read ({e.__class__.__name__}: {e})") from None
    jsonl = path.suffix in (".jsonl", ".json")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            items.append({"prompt": line.replace("\\n", "\n")})
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise InputError(f"--prompts {path}, line {n}: not JSON") from None
        ok = isinstance(item, dict) and (isinstance(item.get("prompt"), str) and item["prompt"] or isinstance(
            item.get("messages"), list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  for m in item["messages"]))
        if not ok:
            raise InputError(f"--prompts {path}, line {n}: give {{\"prompt\": text}} or {{\"messages\": [...]}}")
        items.append({k: item[k] for k in ("prompt", "messages") if k in item})
    return items


def verify_server(model: str | Path | None, url: str, dtype: str = "auto", api_key: str | None = None,
                  served_model: str | None = None, prompts: Path | None = None, new_tokens: int = 16,
                  top_logprobs: int = 5, timeout: float = 120.0, revision: str | None = None,
                  progress=lambda text: None) -> ServedReport:
    t0 = time.perf_counter()
    if new_tokens < 1:
        raise InputError(f"--new-tokens must be at least 1, got {new_tokens}")
    if not 1 <= top_logprobs <= 20:
        raise InputError(f"--top-logprobs must be 1 to 20, got {top_logprobs}")
    items = read_prompts(prompts)
    m = open_model(model, revision)
    if not has_tokenizer(m.path):
        raise InputError(f"{m.path} has no tokenizer: a server is checked on text, which needs the model's own")
    claimed = pick_dtype(dtype, m.spec)
    # A GGUF's reference is llama.cpp on the file, at the rounding of its weights' type (or of the
    # server's claim, where that is coarser: a float16 KV cache over float32 weights, say).
    file_rounding = llamacpp_activations(m.spec, m.config.get("gguf_weights", "F32")) if m.is_gguf else None
    rounding = activations_of(claimed) if not m.is_gguf or dtype != "auto" else file_rounding
    if file_rounding is not None and TOLERANCE[file_rounding] > TOLERANCE[rounding]:
        rounding = file_rounding
    tok = Tokenizer(m.path)
    client = Client(url, api_key, timeout)
    listed = client.get("/v1/models").get("data")
    if not served_model:
        if not (isinstance(listed, list) and listed and isinstance(listed[0], dict) and listed[0].get("id")):
            raise ServerFailed(f"{client.root}/v1/models lists no model", hint="give --served-model-name")
        served_model = str(listed[0]["id"])
    owned_by = next((str(e.get("owned_by", "")) for e in listed or [] if isinstance(e, dict)
                     and e.get("id") == served_model), "")
    asker = Asker(client, served_model, owned_by, tok, m.spec.vocab_size, new_tokens, top_logprobs)
    found = asker.found

    # 1. Ask the server everything first; the reference then runs once over what it answered.
    asked, counts, refused, missing = [], {"prompt": 0, "chat": 0}, None, []
    for n, item in enumerate(items, 1):
        progress(f"asking the server ({n}/{len(items)})")
        kind = "chat" if "messages" in item else "prompt"
        counts[kind] += 1
        name = f"{kind} {counts[kind]}"
        try:
            answer = asker.chat(item["messages"], name) if kind == "chat" else asker.completion(item["prompt"], name)
        except Refused as e:  # one prompt refused (longer than its context, say): the others still tell
            if e.status not in (400, 413, 422):
                raise
            missing.append(f"{name} not checked: {e.message}")
            refused = e
            continue
        if answer is not None:
            asked.append(answer)
    if not asked:
        raise refused or ServerFailed("no prompt could be checked: the model has no chat template for the "
                                      "conversations given")
    caps = found.capabilities
    if caps["logprobs"] is False:
        missing.append("the server returns no logprobs: only the tokenizer, the chat template and the greedy "
                       "tokens (against the reference's first choices) were checked")
    if caps["tokenize"] is False:
        missing.append("no /tokenize: the tokenizer was checked by the prompt counts in `usage`")
    if not caps["prompt_logprobs"]:
        missing.append("no prompt logprobs (echo or prompt_logprobs): only generated positions were compared")
    if found.template["checked"] is None:
        missing.append("no chat template check: " + (found.no_template or "no conversation was asked"))

    # 2. The reference, teacher-forced on the server's tokens.
    progress("running the reference")
    ref = Reference(m, claimed)
    bounds = Bounds(rounding, False)
    comparisons = against_reference(asked, ref, bounds, new_tokens, top_logprobs, tok)

    diagnosis = []
    if not found.tokenizer["passed"]:
        diagnosis.append("tokenizer")
    chat_failed = any(not c.passed for c in comparisons if c.kind == "chat")
    plain_failed = any(not c.passed for c in comparisons if c.kind == "completion")
    if not found.template["passed"] or (chat_failed and not plain_failed):
        found.template["passed"] = False
        found.template["finding"] = found.template["finding"] or (
            "the chat answers' logprobs are off the reference on the model's own rendering, while plain "
            "completions agree")
        diagnosis.append("chat template")
    if plain_failed:
        diagnosis.append("logits")
    return ServedReport(
        model=m.resolved.name, url=client.root, served_model=served_model, dtype=claimed, reference=ref.describe(),
        tolerance=bounds.logprob, kld_bound=bounds.kld, top_logprobs=top_logprobs, tokenizer=found.tokenizer,
        template=found.template, comparisons=comparisons, capabilities=caps, missing=missing, diagnosis=diagnosis,
        passed=not diagnosis, environment=environment("cpu"), seconds=time.perf_counter() - t0)


def against_reference(asked: list[Asked], ref: Reference, bounds: Bounds, new_tokens: int, k: int,
                      tok: Tokenizer) -> list[Comparison]:
    """Each answer beside the reference's logits over the same tokens (its own greedy text beside a
    text-only answer); the bounds scale with the largest logit seen."""
    rows = []
    with ref.opened(max(len(a.prompt) + max(len(a.generated), new_tokens) for a in asked) + 1):
        bounds.reference_rounds = ref.label != "float32"  # a model too big for float32 here, or llama.cpp
        for a in asked:
            if isinstance(a.generated, str):
                greedy, logits = ref.greedy(a.prompt, new_tokens)
                rows.append((greedy, logits))
                bounds.see(logits)
                continue
            known = []
            for s in a.generated:
                if s.id is None or not 0 <= s.id < ref.m.spec.vocab_size:
                    break  # compare() says which, and why the positions after it are not compared
                known.append(s.id)
            logits = ref.logits(a.prompt + known[:-1] if known else a.prompt)
            bounds.see(logits)
            rows.append(log_softmax(logits))
    return [compare_text(a.name, a.kind, a.prompt, a.generated, *row, tok, bounds) if isinstance(a.generated, str)
            else compare(a.name, a.kind, a.prompt, a.generated, a.scored_prompt, row, bounds, k)
            for a, row in zip(asked, rows)]
