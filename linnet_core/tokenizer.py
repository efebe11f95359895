"""Tokenizers from checkpoint folders: `tokenizer.json` through `tokenizers`, chat templates via Jinja.

Reading the files directly keeps `linnet run` light; checkpoints with only a SentencePiece
model fall back to transformers' AutoTokenizer.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InputError
from .gguf.reader import GGUFFile
from .gguf.tokenizer import read_vocabulary, tokenizer_from_gguf


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not valid JSON") from None
    return data if isinstance(data, dict) else {}


def read_chat_template(folder: Path, tokenizer_config: dict | None = None) -> str | None:
    """The chat template, from `chat_template.jinja`, `tokenizer_config.json` or `chat_template.json`."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = tokenizer_config if tokenizer_config is not None else _read_json(folder / "tokenizer_config.json")
    template = cfg.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    def __init__(self, folder: Path):
        """The tokenizer of a checkpoint folder, or the one a GGUF file carries."""
        self.folder = folder
        self._compiled_template = None
        if folder.is_file():
            self._from_gguf(folder)
            return
        cfg = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = read_chat_template(folder, cfg)
        path = folder / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(str(path))
            except Exception as e:  # the Rust parser reports its own reason
                raise CheckpointError(f"{path}: cannot be read as a tokenizer ({e})") from None
            self._fallback = None
        elif (folder / "tokenizer.model").is_file():
            from transformers import AutoTokenizer

            # remote code refused: a checkpoint's `auto_map` must neither run code nor prompt on a TTY
            try:
                self._fallback = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
            except (ValueError, OSError, ImportError) as e:
                raise CheckpointError(f"{folder}: the tokenizer cannot be loaded "
                                      f"({(str(e).splitlines() or [type(e).__name__])[0][:200]})") from None
            self._tok = None
        else:
            raise CheckpointError(f"{folder}: no tokenizer.json or tokenizer.model", hint="pass token ids instead")
        gen = _read_json(folder / "generation_config.json")
        eos = gen.get("eos_token_id")
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        if self.eos_token is not None and self.token_id(self.eos_token) is not None:
            self.eos_ids.add(self.token_id(self.eos_token))

    def _from_gguf(self, path: Path) -> None:
        with GGUFFile(path) as g:
            voc = read_vocabulary(g)
        built = tokenizer_from_gguf(voc)
        self._tok, self._fallback = built.tokenizer, None
        self.bos_token, self.eos_token, self.chat_template = built.bos_token, built.eos_token, built.chat_template
        self.eos_ids = {i for i in (voc.eos, voc.eot) if i is not None}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size() if self._tok else len(self._fallback)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token) if self._tok else self._fallback.convert_tokens_to_ids(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._fallback.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._fallback.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether pieces are GPT-2 byte-level characters (the decoder says so) rather than SentencePiece's."""
        if self._tok is None:
            return False
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or [] if isinstance(d, dict)}
        return "ByteLevel" in kinds

    def special_ids(self) -> set[int]:
        """Ids of the special tokens (chat markers, end of text): never part of generated text."""
        if self._tok is not None:
            return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return set(self._fallback.all_special_ids)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for in decoded text (a piece of a UTF-8 character, possibly),
        as the OpenAI API's logprobs report them."""
        piece = self._tok.id_to_token(token) if self._tok else self._fallback.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if self._byte_level:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode()  # an added token kept as written
        byte = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` rendered by the checkpoint's template, ready for the reply; `tools`
        (OpenAI's function definitions) passed to the template as transformers passes them."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text of `messages` rendered by the checkpoint's template, ready for the reply."""
        if not self.chat_template:
            # no folder in the message: a server sends it to clients
            raise InputError("the model has no chat template", hint="drop --chat to send the prompt as it is")
        from jinja2 import TemplateError

        try:
            text = self._chat_renderer().render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "", **({"tools": tools} if tools else {}),
            )
        except TemplateError as e:
            raise InputError(f"the checkpoint's chat template failed to render: {e}") from None
        return text

    def _chat_renderer(self):
        """The chat template compiled once (a server renders it for every request)."""
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # The environment transformers renders chat templates in, so templates behave the same.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message: str):
                raise InputError(f"the chat template refused the messages: {message}")

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template


class IncrementalDecoder:
    """Text deltas for a growing token list that never split a UTF-8 character.

    Decodes a short window and holds text back while it ends in U+FFFD (an incomplete byte
    sequence), as TGI and vLLM do.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is left when generation ends (a trailing partial character included)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
