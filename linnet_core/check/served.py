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
import importlib.metadata
import json
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..bench.machine import cpu_name
from ..compile import Model, open_model, pick_dtype
from ..dtypes import FORMATS
from ..errors import InputError
from ..gguf.llamacpp_reference import llamacpp, native_stderr_kept
from ..tokenizer import Tokenizer
from .agreement import TOLERANCE, log_softmax
from .prompts import DEFAULT_PROMPT, UNSEEN_TEXT, has_tokenizer
from .reference import as_quantized, load_reference, reference_dtype, run_reference
from .server_api import (Client, Refused, Scored, ServerFailed, TokenIds, first_choice, read_llamacpp_native,
                         read_logprobs, read_prompt_logprobs)
from .verify import LLAMACPP_ACTIVATIONS

# Prompts that exercise the tokenizer (digits, code, accents, CJK, emoji) and, the last, positions
# far enough out that a wrong rope base shows.
DEFAULT_PROMPTS = (
    DEFAULT_PROMPT,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])  # 0, 1, 1, 2,",
    "Ça coûte 12,50 € — naïve café, Straße, 東京 and 🙂; in 1984, 3.14159 × 42 =",
    UNSEEN_TEXT.read_text()[:640].rsplit(" ", 1)[0],
)
CHAT = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "What does a tokenizer do?"}]


@dataclass
class Comparison:
    """One request's tokens against the reference's distributions at the same positions."""
    name: str
    kind: str  # completion | chat
    prompt_tokens: int
    tokens: list[int | None]  # the server's greedy tokens (None: not identified)
    compared: int  # positions compared: the generated ones, then any prompt positions it scored
    agreement: int  # generated tokens that match the reference's first choice before the first that does not
    decisive_divergence: int | None  # first generated position where the server's token is clearly not the reference's first
    max_dlogprob: float | None  # chosen tokens
    max_dlogprob_top: float | None  # the alternatives the server listed
    top_overlap: float | None  # mean share of the server's top-k that is the reference's top-k
    kld: float | None  # mean over positions, over the server's top-k and the rest
    prompt_logprobs: int = 0  # prompt positions the server scored (echo / prompt_logprobs)
    logprobs: list[float | None] = field(default_factory=list)  # the server's chosen-token logprobs (baselines)
    passed: bool = True
    finding: str | None = None


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


class Bounds:
    """The claimed dtype's tolerance at the size of the reference's logits: a logprob is a logit less
    a log-sum, each rounded, so twice the logit tolerance; a KL divergence of at most half its square
    (Hoeffding's bound for logits off by at most the tolerance)."""

    def __init__(self, activations: str, reference_rounds: bool):
        self.activations, self.reference_rounds, self.scale = activations, reference_rounds, 1.0

    def see(self, logits: np.ndarray) -> None:
        self.scale = max(self.scale, float(np.abs(logits).max()))

    @property
    def logit(self) -> float:
        t = TOLERANCE[self.activations] * self.scale
        return 2 * t if self.reference_rounds else t  # two roundings, not one

    @property
    def logprob(self) -> float:
        return 2 * self.logit

    @property
    def kld(self) -> float:
        return self.logit ** 2 / 2


def compare(name: str, kind: str, prompt: list[int], generated: list[Scored], scored_prompt: list[Scored],
            logp: np.ndarray, bounds: Bounds, k: int) -> Comparison:
    """The server's tokens against the reference's log-probabilities `logp` [T, V] over prompt +
    generated (teacher-forced on the server's own tokens)."""
    tol = bounds.logprob
    chosen, listed, overlaps, klds = [], [], [], []
    agreement, diverged, decisive = 0, False, None

    def position(row: np.ndarray, s: Scored) -> None:
        if s.id is not None and s.logprob is not None:
            chosen.append(abs(s.logprob - row[s.id]))
        named = [(i, lp) for i, lp in s.top[:k] if i is not None and 0 <= i < len(row)]
        listed.extend(abs(lp - row[i]) for i, lp in named)
        if named:
            ref_top = set(np.argpartition(-row, len(named) - 1)[:len(named)].tolist())
            overlaps.append(len(ref_top & {i for i, _ in named}) / len(named))
            p = np.exp(np.array([row[i] for i, _ in named]))
            q = np.exp(np.array([lp for _, lp in named]))
            p_rest, q_rest = max(1 - p.sum(), 1e-12), max(1 - q.sum(), 1e-12)
            klds.append(float((p * (np.log(p) - np.log(np.maximum(q, 1e-30)))).sum()
                              + p_rest * (np.log(p_rest) - np.log(q_rest))))

    for j, s in enumerate(generated):
        row = logp[len(prompt) - 1 + j]
        if s.id is None:
            break  # a token not identified: the positions after it have no known context
        position(row, s)
        best = int(row.argmax())
        if s.id != best:
            diverged = True
            if decisive is None and row[best] - row[s.id] > tol:
                decisive = j
        if not diverged:
            agreement += 1
    for t, s in enumerate(scored_prompt[1:len(prompt)], start=1):  # position t - 1 predicts prompt[t]
        position(logp[t - 1], Scored(prompt[t], s.text, s.logprob, s.top))
    top = lambda v: max(v) if v else None  # noqa: E731
    c = Comparison(name, kind, len(prompt), [s.id for s in generated], len(chosen), agreement, decisive,
                   top(chosen), top(listed), float(np.mean(overlaps)) if overlaps else None,
                   float(np.mean(klds)) if klds else None, max(0, min(len(scored_prompt), len(prompt)) - 1),
                   [s.logprob for s in generated])
    problems = []
    if c.max_dlogprob is not None and c.max_dlogprob > tol:
        problems.append(f"a chosen token's logprob is {c.max_dlogprob:.3g} off the reference's (tolerance {tol:.3g})")
    if c.max_dlogprob_top is not None and c.max_dlogprob_top > tol:
        problems.append(f"a listed alternative's logprob is {c.max_dlogprob_top:.3g} off (tolerance {tol:.3g})")
    if c.kld is not None and c.kld > bounds.kld:
        problems.append(f"KL divergence over the top-{k} {c.kld:.3g} (bound {bounds.kld:.3g})")
    if decisive is not None:
        problems.append(f"greedy token {decisive + 1} is not the reference's first choice, which leads it by "
                        f"more than the tolerance")
    if generated and generated[0].id is None:
        problems.append("the server's tokens could not be identified in the model's vocabulary")
    c.passed, c.finding = not problems, "; ".join(problems) or None
    return c


def compare_text(name: str, kind: str, prompt: list[int], text: str, greedy: list[int], logits: np.ndarray,
                 tok: Tokenizer, bounds: Bounds) -> Comparison:
    """A server's text (no logprobs) against the reference's greedy tokens `greedy` (with their logits
    [n, V]): agreement up to the token where the texts part; decisive where the reference's first
    choice there led its second by more than the tolerance (then no other token could be right)."""
    agreement, decisive = len(greedy), None
    # Whole texts compared (a prefix may end inside a UTF-8 character), without U+FFFD: decoders
    # render broken bytes as one or several, which says nothing about the model.
    def plain(t: str) -> str:
        return t.replace("\ufffd", "")

    text, ref_text = plain(text), plain(tok.decode(greedy))
    i = first_difference(text, ref_text)
    if i < len(text) and i < len(ref_text):  # they part (a shorter text is a stop, not a difference)
        agreement = next((j for j in range(len(greedy)) if len(plain(tok.decode(greedy[:j + 1]))) > i),
                         len(greedy) - 1)
        top2 = np.sort(logits[agreement])[-2:]
        decisive = agreement if top2[1] - top2[0] > bounds.logprob else None
    c = Comparison(name, kind, len(prompt), greedy[:agreement], 0, agreement, decisive, None, None, None, None)
    if decisive is not None:
        c.passed, c.finding = False, (f"the text parts from the reference's greedy text at token {decisive + 1}, where "
                                      f"the reference's first choice leads by more than the tolerance")
    return c


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Probe:
    """What the server offers, learnt by asking once: /tokenize, echo, prompt logprobs, chat rendering."""

    def __init__(self, client: Client, model: str, owned_by: str):
        self.client, self.model = client, model
        self.vllm, self.ids_field = owned_by == "vllm", owned_by in ("vllm", "linnet")
        self.llamacpp = owned_by == "llamacpp"
        self.tokenize_ok: bool | None = None
        self.echo: bool | None = None

    def tokenize(self, text: str) -> list[int] | None:
        if self.tokenize_ok is False:
            return None
        # "prompt" for vLLM, SGLang and Linnet; "content" and "add_special" for llama-server; "inputs"
        # for TGI, which answers a list of {id, text, start, stop}
        out = self.client.optional("/tokenize", {"model": self.model, "prompt": text, "content": text,
                                                 "inputs": text, "add_special_tokens": True, "add_special": True},
                                   shapes=(dict, list))
        ids = out.get("tokens") if isinstance(out, dict) else [t.get("id") if isinstance(t, dict) else None
                                                               for t in out] if out else None
        self.tokenize_ok = isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        return ids if self.tokenize_ok else None

    def chat_rendering(self, messages: list[dict]) -> tuple[str, list[int] | str] | None:
        """The server's own chat prompt: ids from /tokenize with messages (vLLM, Linnet), or the text
        from /apply-template (llama-server)."""
        out = self.client.optional("/tokenize", {"model": self.model, "messages": messages,
                                                 "add_generation_prompt": True})
        if out and isinstance(out.get("tokens"), list) and out["tokens"]:
            return "/tokenize with messages", out["tokens"]
        out = self.client.optional("/apply-template", {"messages": messages})
        if out and isinstance(out.get("prompt"), str):
            return "/apply-template", out["prompt"]
        return None

    def extra(self, k: int) -> dict:
        """Fields that get token ids and prompt logprobs where the server is known to take them."""
        return {**({"return_tokens_as_token_ids": True} if self.ids_field else {}),
                **({"prompt_logprobs": k} if self.vllm else {})}


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
    file_rounding = LLAMACPP_ACTIVATIONS.get(m.config.get("gguf_weights", "F32"), "int8/256") if m.is_gguf else None
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
    probe = Probe(client, served_model, owned_by)
    ids_of = TokenIds(tok)
    missing: list[str] = []
    tokenizer = {"checked": None, "passed": True, "findings": []}
    template = {"checked": None, "passed": True, "finding": None}
    caps = {"logprobs": None, "prompt_logprobs": None, "token_ids": None, "tokenize": None, "chat_rendering": None}

    # 1. Ask the server everything first; the reference then runs once over what it answered.
    asked, counts, refused = [], {"prompt": 0, "chat": 0}, None
    for n, item in enumerate(items, 1):
        progress(f"asking the server ({n}/{len(items)})")
        kind = "chat" if "messages" in item else "prompt"
        counts[kind] += 1
        name = f"{kind} {counts[kind]}"
        try:
            if kind == "chat":
                asked.append(_ask_chat(client, probe, tok, item["messages"], new_tokens, top_logprobs, ids_of,
                                       served_model, template, tokenizer, caps, name))
            else:
                asked.append(_ask_completion(client, probe, tok, item["prompt"], new_tokens, top_logprobs, ids_of,
                                             served_model, tokenizer, caps, name))
        except Refused as e:  # one prompt refused (longer than its context, say): the others still tell
            if e.status not in (400, 413, 422):
                raise
            missing.append(f"{name} not checked: {e.message}")
            refused = e
    asked = [a for a in asked if a is not None]
    if not asked:
        raise refused or ServerFailed("no prompt could be checked: the model has no chat template for the "
                                      "conversations given")
    if caps["logprobs"] is False:
        missing.append("the server returns no logprobs: only the tokenizer, the chat template and the greedy "
                       "tokens (against the reference's first choices) were checked")
    if caps["tokenize"] is False:
        missing.append("no /tokenize: the tokenizer was checked by the prompt counts in `usage`")
    if not caps["prompt_logprobs"]:
        missing.append("no prompt logprobs (echo or prompt_logprobs): only generated positions were compared")

    # 2. The reference, teacher-forced on the server's tokens.
    bounds = Bounds(rounding, False)
    ref = Reference(m, claimed)
    comparisons = []
    longest = max(len(a["prompt"]) + max(len(a["generated"]), new_tokens) for a in asked)
    progress("running the reference")
    with ref.opened(longest + 1):
        bounds.reference_rounds = ref.label != "float32"
        for a in asked:
            if isinstance(a["generated"], str):  # text only: the reference's own greedy text beside it
                a["greedy"] = ref.greedy(a["prompt"], new_tokens)
                bounds.see(a["greedy"][1])
                continue
            gen_ids = []
            for s in a["generated"]:
                if s.id is None:
                    break
                gen_ids.append(s.id)
            seq = a["prompt"] + gen_ids[:-1] if gen_ids else a["prompt"]
            logits = ref.logits(seq)
            bounds.see(logits)
            a["logp"] = log_softmax(logits)
        for a in asked:
            comparisons.append(compare_text(a["name"], a["kind"], a["prompt"], a["generated"], *a["greedy"], tok, bounds)
                               if "greedy" in a else
                               compare(a["name"], a["kind"], a["prompt"], a["generated"], a["scored_prompt"],
                                       a["logp"], bounds, top_logprobs))
    if template["checked"] is None:
        missing.append("no chat template check: " + (template.pop("why", None) or "no conversation was asked"))
    template.pop("why", None)
    diagnosis = []
    if not tokenizer["passed"]:
        diagnosis.append("tokenizer")
    chat_failed = any(not c.passed for c in comparisons if c.kind == "chat")
    plain_failed = any(not c.passed for c in comparisons if c.kind == "completion")
    if not template["passed"] or (chat_failed and not plain_failed):
        template["passed"] = False
        template["finding"] = template["finding"] or ("the chat answers' logprobs are off the reference on the "
                                                      "model's own rendering, while plain completions agree")
        diagnosis.append("chat template")
    if plain_failed:
        diagnosis.append("logits")
    return ServedReport(
        model=m.resolved.name, url=client.root, served_model=served_model, dtype=claimed, reference=ref.describe(),
        tolerance=bounds.logprob, kld_bound=bounds.kld, top_logprobs=top_logprobs, tokenizer=tokenizer,
        template=template, comparisons=comparisons, capabilities=caps, missing=missing, diagnosis=diagnosis,
        passed=not diagnosis, environment=_environment(), seconds=time.perf_counter() - t0)


def _environment() -> dict:
    """This machine and versions (the server's are its own: a baseline is compared on the same setup)."""
    def version(d: str) -> str | None:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "cpu": cpu_name(),
            "versions": {d: v for d in ("linnet", "torch", "transformers", "llama-cpp-python") if (v := version(d))}}


def _generated(choice: dict, ids_of: TokenIds, tok: Tokenizer, caps: dict) -> list[Scored] | str:
    """The generated tokens with logprobs; without logprobs, only the text (its tokens are not known:
    a text need not split back into the tokens that wrote it)."""
    scored = read_logprobs(choice, ids_of)
    if scored is None:
        caps["logprobs"] = False
        text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
        return text if isinstance(text, str) else ""
    caps["logprobs"] = True
    if scored and caps["token_ids"] is None:
        caps["token_ids"] = "ids in the answer" if any(
            isinstance(e, dict) and "id" in e for e in (choice.get("logprobs") or {}).get("content") or []) \
            else "token_id:N" if scored[0].text.startswith("token_id:") else "bytes looked up in the vocabulary"
    return scored


def _ask_llamacpp(client, probe: Probe, text: str, new_tokens: int, k: int, caps: dict) -> list[Scored] | None:
    """llama-server's /completion with `return_tokens` and `n_probs`; None where it does not answer so."""
    answer = client.optional("/completion", {"prompt": text, "n_predict": new_tokens, "temperature": 0,
                                             "n_probs": k, "return_tokens": True, "cache_prompt": False})
    scored = read_llamacpp_native(answer) if answer else None
    if scored is not None:
        caps["logprobs"], caps["token_ids"] = True, "llama-server's /completion (return_tokens)"
    return scored


def _ask_completion(client, probe: Probe, tok: Tokenizer, text: str, new_tokens: int, k: int, ids_of: TokenIds,
                    served_model: str, tokenizer: dict, caps: dict, name: str) -> dict:
    mine = tok.encode(text)
    theirs = probe.tokenize(text)
    caps["tokenize"] = probe.tokenize_ok
    body = {"model": served_model, "prompt": text, "max_tokens": new_tokens, "temperature": 0, "logprobs": k,
            **probe.extra(k)}
    if probe.llamacpp:  # its own endpoint names every generated token (its OpenAI one drops some)
        native = _ask_llamacpp(client, probe, text, new_tokens, k, caps)
        if native is not None:
            if theirs is not None and theirs != mine:
                i = first_difference(theirs, mine)
                tokenizer["passed"] = False
                tokenizer["findings"].append(
                    f"{name}: the server splits the text into {len(theirs)} tokens, the model's tokenizer into "
                    f"{len(mine)}; first difference at token {i}: server {_pieces(tok, theirs[i:i + 3])} vs "
                    f"model {_pieces(tok, mine[i:i + 3])}")
            tokenizer["checked"] = "/tokenize" if theirs is not None else tokenizer["checked"]
            return {"name": name, "kind": "completion", "prompt": theirs if theirs is not None else mine,
                    "generated": native, "scored_prompt": []}
    answer = None
    if probe.echo is not False:
        try:
            answer = client.post("/v1/completions", {**body, "echo": True})
            probe.echo = True
        except Refused:
            probe.echo = False
    if answer is None:
        answer = client.post("/v1/completions", body)
    choice = first_choice(answer, f"{client.root}/v1/completions")
    used = (answer.get("usage") or {}).get("prompt_tokens")
    scored = _generated(choice, ids_of, tok, caps)
    scored_prompt: list[Scored] = []
    prompt = theirs if theirs is not None else mine
    made = (answer.get("usage") or {}).get("completion_tokens")
    # A server may take `echo` and still score only what it generated (llama-server): the count tells.
    n_prompt = (len(scored) - made if isinstance(made, int) and made <= len(scored)
                else len(prompt) if scored and scored[0].logprob is None else 0) if probe.echo and caps["logprobs"] else 0
    if n_prompt:
        scored_prompt, scored = scored[:n_prompt], scored[n_prompt:]
        if theirs is None:  # the echoed tokens are the server's own split of the prompt
            echoed = [s.id for s in scored_prompt]
            if None not in echoed:
                prompt = echoed
        caps["prompt_logprobs"] = "echo"
    elif (pl := read_prompt_logprobs(choice, prompt, k)) is not None:
        scored_prompt, caps["prompt_logprobs"] = pl, "prompt_logprobs"
    # The tokenizer: the server's split of the text, else its count of the prompt's tokens.
    if theirs is not None or prompt is not mine:
        tokenizer["checked"] = "/tokenize" if theirs is not None else "echoed prompt tokens"
        if prompt != mine:
            i = first_difference(prompt, mine)
            tokenizer["passed"] = False
            tokenizer["findings"].append(
                f"{name}: the server splits the text into {len(prompt)} tokens, the model's tokenizer into "
                f"{len(mine)}; first difference at token {i}: server {_pieces(tok, prompt[i:i + 3])} vs "
                f"model {_pieces(tok, mine[i:i + 3])}")
    elif isinstance(used, int):
        tokenizer["checked"] = tokenizer["checked"] or "prompt counts in usage"
        if used != len(mine):
            tokenizer["passed"] = False
            tokenizer["findings"].append(f"{name}: the server counts {used} prompt tokens, the model's tokenizer "
                                         f"gives {len(mine)}")
    return {"name": name, "kind": "completion", "prompt": prompt, "generated": scored, "scored_prompt": scored_prompt}


def _ask_chat(client, probe: Probe, tok: Tokenizer, messages: list[dict], new_tokens: int, k: int, ids_of: TokenIds,
              served_model: str, template: dict, tokenizer: dict, caps: dict, name: str) -> dict | None:
    if not tok.chat_template:
        template["why"] = "the model has no chat template"
        return None
    text = tok.render_chat(messages)
    mine = tok.encode(text, add_special_tokens=False)
    rendered = probe.chat_rendering(messages)
    caps["chat_rendering"] = rendered[0] if rendered else None
    body = {"model": served_model, "messages": messages, "max_tokens": new_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": k}
    if probe.ids_field:
        body["return_tokens_as_token_ids"] = True
    answer = client.post("/v1/chat/completions", body)
    choice = first_choice(answer, f"{client.root}/v1/chat/completions")
    used = (answer.get("usage") or {}).get("prompt_tokens")
    generated = _generated(choice, ids_of, tok, caps)
    if probe.llamacpp and rendered and isinstance(rendered[1], str):  # every token named: its own endpoint
        generated = _ask_llamacpp(client, probe, rendered[1], new_tokens, k, caps) or generated
    template["checked"] = template["checked"] or (rendered[0] if rendered else "prompt counts in usage"
                                                  if isinstance(used, int) else "the answers' logprobs")
    theirs = None  # the server's own tokens for the conversation, where it tells them
    finding = None
    if rendered and isinstance(rendered[1], str):
        theirs = probe.tokenize(rendered[1])
        if rendered[1] != text:
            i = first_difference(rendered[1], text)
            finding = (f"{name}: the server renders the conversation differently from the model's template from "
                       f"character {i}: server {rendered[1][i:i + 40]!r} vs template {text[i:i + 40]!r}")
    elif rendered:
        theirs = rendered[1]
        said = tok.decode(theirs, skip_special_tokens=False)
        if said != text:
            i = first_difference(said, text)
            finding = (f"{name}: the server's chat prompt reads differently from the model's template from "
                       f"character {i}: server {said[i:i + 40]!r} vs template {text[i:i + 40]!r}")
        elif theirs != mine:  # the same text, split differently: the tokenizer's doing, not the template's
            i = first_difference(theirs, mine)
            tokenizer["passed"] = False
            tokenizer["findings"].append(f"{name}: the chat prompt's text is the model's, split into {len(theirs)} "
                                         f"tokens where the model's tokenizer gives {len(mine)}; first difference "
                                         f"at token {i}: server {_pieces(tok, theirs[i:i + 3])} vs model "
                                         f"{_pieces(tok, mine[i:i + 3])}")
    elif isinstance(used, int) and used != len(mine):
        finding = (f"{name}: the server counts {used} prompt tokens for the conversation, the model's template "
                   f"renders {len(mine)}")
    if finding:
        template["passed"], template["finding"] = False, finding
    return {"name": name, "kind": "chat", "prompt": theirs or mine, "generated": generated,
            "scored_prompt": []}


def _pieces(tok: Tokenizer, ids: list[int]) -> str:
    return "[" + ", ".join(repr(tok.token_bytes(i).decode("utf-8", "replace")) for i in ids) + "]"
