"""What `verify --url` asks a server, and what it learns on the way: the server's greedy tokens with
their logprobs (and the prompt's, where it scores them), its split of each text, and its rendering
of a conversation, set beside the model's own tokenizer and template.

Each server is asked in the fields its documentation gives; what it does not offer is learnt once
(a refusal, a 404) and not asked again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tokenizer import Tokenizer
from .server_api import (Client, Refused, Scored, TokenIds, first_choice, read_llamacpp_native, read_logprobs,
                         read_prompt_logprobs)


@dataclass
class Asked:
    """One request's answer: the prompt's tokens as the server took them (its own split where it
    tells), its greedy tokens with logprobs (only the text when it gives no logprobs) and any prompt
    positions it scored."""
    name: str
    kind: str  # completion | chat
    prompt: list[int]
    generated: list[Scored] | str
    scored_prompt: list[Scored] = field(default_factory=list)


@dataclass
class Findings:
    """What the answers say about the tokenizer and the chat template, and what the server offers."""
    tokenizer: dict = field(default_factory=lambda: {"checked": None, "passed": True, "findings": []})
    template: dict = field(default_factory=lambda: {"checked": None, "passed": True, "finding": None})
    capabilities: dict = field(default_factory=lambda: dict.fromkeys(
        ("logprobs", "prompt_logprobs", "token_ids", "tokenize", "chat_rendering")))
    no_template: str | None = None  # why the template was not checked


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Asker:
    def __init__(self, client: Client, served_model: str, owned_by: str, tok: Tokenizer, vocab_size: int,
                 new_tokens: int, k: int):
        self.client, self.model, self.tok, self.new_tokens, self.k = client, served_model, tok, new_tokens, k
        self.vocab_size = vocab_size
        self.ids_of = TokenIds(tok)
        self.vllm, self.llamacpp = owned_by == "vllm", owned_by == "llamacpp"
        self.ids_field = owned_by in ("vllm", "linnet")  # they take return_tokens_as_token_ids
        self.found = Findings()
        self._tokenize_ok: bool | None = None
        self._echo: bool | None = None

    # -- plain completions ------------------------------------------------------------------------

    def completion(self, text: str, name: str) -> Asked:
        caps = self.found.capabilities
        mine = self.tok.encode(text)
        theirs = self.tokenize(text)
        caps["tokenize"] = self._tokenize_ok
        prompt = theirs if theirs is not None else mine
        native = self.llamacpp_completion(text) if self.llamacpp else None
        if native is not None:  # its own endpoint names every generated token (its OpenAI one drops some)
            asked, used = Asked(name, "completion", prompt, native), None
        else:
            asked, used = self._openai_completion(text, prompt, name)
        # The tokenizer: the server's split of the text (told, or echoed), else its count of the tokens.
        if asked.prompt is not mine:
            self.found.tokenizer["checked"] = "/tokenize" if theirs is not None else "echoed prompt tokens"
            if asked.prompt != mine:
                self._split_differs(f"{name}: the server splits the text", asked.prompt, mine)
        elif isinstance(used, int):
            self.found.tokenizer["checked"] = self.found.tokenizer["checked"] or "prompt counts in usage"
            if used != len(mine):
                self._tokenizer_finding(f"{name}: the server counts {used} prompt tokens, the model's tokenizer "
                                        f"gives {len(mine)}")
        return asked

    def _openai_completion(self, text: str, prompt: list[int], name: str) -> tuple[Asked, int | None]:
        """/v1/completions, with `echo` while the server takes it: (the answer, its prompt count)."""
        caps = self.found.capabilities
        body = {"model": self.model, "prompt": text, "max_tokens": self.new_tokens, "temperature": 0,
                "logprobs": self.k, **({"return_tokens_as_token_ids": True} if self.ids_field else {}),
                **({"prompt_logprobs": self.k} if self.vllm else {})}
        if self._echo is False:
            answer = self.client.post("/v1/completions", body)
        else:
            try:
                answer = self.client.post("/v1/completions", {**body, "echo": True})
                self._echo = True
            except Refused:
                answer = self.client.post("/v1/completions", body)  # refused too: the prompt, not echo
                self._echo = False
        usage = answer.get("usage") or {}
        choice = first_choice(answer, f"{self.client.root}/v1/completions")
        scored = self._generated(choice)
        asked = Asked(name, "completion", prompt, scored)
        if isinstance(scored, str):
            return asked, usage.get("prompt_tokens")
        made = usage.get("completion_tokens")
        # A server may take `echo` and still score only what it generated (llama-server): the count tells.
        n_prompt = 0
        if self._echo:
            n_prompt = (len(scored) - made if isinstance(made, int) and made <= len(scored)
                        else len(prompt) if scored and scored[0].logprob is None else 0)
        if n_prompt:
            asked.scored_prompt, asked.generated = scored[:n_prompt], scored[n_prompt:]
            echoed = [s.id for s in asked.scored_prompt]
            if None not in echoed and self._tokenize_ok is not True and self.in_vocabulary(echoed, "echo"):
                asked.prompt = echoed  # the echoed tokens are the server's own split of the prompt
            caps["prompt_logprobs"] = "echo"
        elif (scored_prompt := read_prompt_logprobs(choice, prompt, self.k)) is not None:
            asked.scored_prompt, caps["prompt_logprobs"] = scored_prompt, "prompt_logprobs"
        return asked, usage.get("prompt_tokens")

    def llamacpp_completion(self, prompt: str | list[int]) -> list[Scored] | None:
        """llama-server's /completion (a text, or ids taken as they are) with `return_tokens` and
        `n_probs`; None where it does not answer so."""
        answer = self.client.optional("/completion", {"prompt": prompt, "n_predict": self.new_tokens, "temperature": 0,
                                                      "n_probs": self.k, "return_tokens": True, "cache_prompt": False})
        scored = read_llamacpp_native(answer) if answer else None
        if scored is not None:
            caps = self.found.capabilities
            caps["logprobs"], caps["token_ids"] = True, "llama-server's /completion (return_tokens)"
        return scored

    # -- chat ---------------------------------------------------------------------------------------

    def chat(self, messages: list[dict], name: str) -> Asked | None:
        """A chat answer, and the server's rendering of the conversation against the model's template;
        None when the model has no template to compare with."""
        template = self.found.template
        if not self.tok.chat_template:
            self.found.no_template = "the model has no chat template"
            return None
        text = self.tok.render_chat(messages)
        mine = self.tok.encode(text, add_special_tokens=False)
        rendered = self.chat_rendering(messages)
        self.found.capabilities["chat_rendering"] = rendered[0] if rendered else None
        body = {"model": self.model, "messages": messages, "max_tokens": self.new_tokens, "temperature": 0,
                "logprobs": True, "top_logprobs": self.k, **({"return_tokens_as_token_ids": True} if self.ids_field
                                                             else {})}
        answer = self.client.post("/v1/chat/completions", body)
        used = (answer.get("usage") or {}).get("prompt_tokens")
        generated = self._generated(first_choice(answer, f"{self.client.root}/v1/chat/completions"))
        template["checked"] = template["checked"] or (rendered[0] if rendered else "prompt counts in usage"
                                                      if isinstance(used, int) else "the answers' logprobs")
        theirs, finding = None, None  # the server's own tokens for the conversation, where it tells them
        if rendered:
            theirs = self.tokenize(rendered[1], add_special=False) if isinstance(rendered[1], str) else rendered[1]
            said = rendered[1] if isinstance(rendered[1], str) else self.tok.decode(theirs, skip_special_tokens=False)
            if said != text:
                i = first_difference(said, text)
                finding = (f"{name}: the server renders the conversation differently from the model's template "
                           f"from character {i}: server {said[i:i + 40]!r} vs template {text[i:i + 40]!r}")
            elif theirs is not None and theirs != mine:  # the same text, split otherwise: the tokenizer's doing
                self._split_differs(f"{name}: the chat prompt's text is the model's, but the server splits it",
                                    theirs, mine)
        elif isinstance(used, int) and used != len(mine):
            finding = (f"{name}: the server counts {used} prompt tokens for the conversation, the model's template "
                       f"renders {len(mine)}")
        if finding:
            template["passed"], template["finding"] = False, finding
        if self.llamacpp and rendered and isinstance(rendered[1], str):  # every token named: its own endpoint,
            generated = self.llamacpp_completion(theirs or rendered[1]) or generated  # on the chat's own ids
        return Asked(name, "chat", theirs or mine, generated)

    # -- what the server offers ---------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int] | None:
        """The server's ids for `text`; `add_special` False for a rendered chat, which holds its own BOS."""
        if self._tokenize_ok is False:
            return None
        # "prompt" for vLLM, SGLang and Linnet; "content" and "add_special" for llama-server; "inputs"
        # for TGI, which answers a list of {id, text, start, stop}
        out = self.client.optional("/tokenize", {"model": self.model, "prompt": text, "content": text,
                                                 "inputs": text, "add_special_tokens": add_special,
                                                 "add_special": add_special}, shapes=(dict, list))
        ids = out.get("tokens") if isinstance(out, dict) else [t.get("id") if isinstance(t, dict) else None
                                                               for t in out] if out else None
        self._tokenize_ok = isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        return self.in_vocabulary(ids, "/tokenize") if self._tokenize_ok else None

    def in_vocabulary(self, ids: list[int], where: str) -> list[int] | None:
        """`ids`, or None (with a tokenizer finding) when some are not in the model's vocabulary: the
        reference cannot run on them."""
        outside = sorted({i for i in ids if not 0 <= i < self.vocab_size})
        if not outside:
            return ids
        self._tokenizer_finding(f"{where} gives token ids {', '.join(map(str, outside[:5]))}, outside the model's "
                                f"vocabulary of {self.vocab_size}")
        return None

    def chat_rendering(self, messages: list[dict]) -> tuple[str, list[int] | str] | None:
        """The server's own chat prompt: ids from /tokenize with messages (vLLM, Linnet), or the text
        from /apply-template (llama-server)."""
        out = self.client.optional("/tokenize", {"model": self.model, "messages": messages,
                                                 "add_generation_prompt": True})
        ids = out.get("tokens") if out else None
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            ids = self.in_vocabulary(ids, "/tokenize with messages")
            return ("/tokenize with messages", ids) if ids is not None else None
        out = self.client.optional("/apply-template", {"messages": messages})
        if out and isinstance(out.get("prompt"), str):
            return "/apply-template", out["prompt"]
        return None

    def _generated(self, choice: dict) -> list[Scored] | str:
        """The generated tokens with logprobs; without logprobs, only the text (its tokens are not
        known: a text need not split back into the tokens that wrote it)."""
        caps = self.found.capabilities
        scored = read_logprobs(choice, self.ids_of)
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

    def _split_differs(self, said: str, theirs: list[int], mine: list[int]) -> None:
        i = first_difference(theirs, mine)
        self._tokenizer_finding(f"{said} into {len(theirs)} tokens, the model's tokenizer into {len(mine)}; first "
                                f"difference at token {i}: server {self._pieces(theirs[i:i + 3])} vs model "
                                f"{self._pieces(mine[i:i + 3])}")

    def _tokenizer_finding(self, text: str) -> None:
        self.found.tokenizer["passed"] = False
        self.found.tokenizer["findings"].append(text)

    def _pieces(self, ids: list[int]) -> str:
        return "[" + ", ".join(repr(self.tok.token_bytes(i).decode("utf-8", "replace")) for i in ids) + "]"
