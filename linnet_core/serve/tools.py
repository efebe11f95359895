"""Tool calls: the request's `tools` checked, the call format read off the model's own chat template,
the model's answer parsed back into OpenAI's `tool_calls`, and the grammar that holds a `required` or
named `tool_choice` to a valid call.

Formats (one small parser each, chosen by what the template writes, never by architecture name;
the models named are those whose released templates write them):
- "tagged": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more (Qwen 2.5
  and 3, Hermes; the template says `<tool_call>`);
- "bare-json": a bare `{"name": ..., "parameters": {...}}` (Llama 3.1 to 3.3; the template asks
  for "parameters" and sets `Environment: ipython`), after an optional `<|python_tag|>`;
- "marked-list": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral's v3 tokenizers: Mistral
  7B v0.3, Nemo; the template writes `[TOOL_CALLS]`), the marker a special token, the ids 9 letters
  and digits, which the template insists on when they come back;
- "functools": `functools[{"name": ..., "arguments": {...}}, ...]` (Phi-4-mini; its template writes the
  tools a system message carries, as JSON text in its `tools` key, between `<|tool|>` and
  `<|/tool|>`: they are put there).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from ..runtime.constraints import GrammarSpec
from .fields import FieldError

MAX_TOOLS = 128
MAX_PARALLEL = 8  # calls one constrained answer may hold


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # where a call starts in the text ("" for a bare JSON answer)
    args_key: str  # "arguments" or "parameters"
    prefix: str  # around each call's JSON in a constrained answer
    suffix: str
    separator: str  # between calls
    parallel: bool
    open: str = ""  # around all the calls
    close: str = ""
    short_ids: bool = False  # ids of 9 letters and digits (Mistral's templates refuse any other)
    tools_in_system: bool = False  # the template reads the tools from the system message, not `tools=`

    def place(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools=) as this format's template takes the tools."""
        if not self.tools_in_system:
            return messages, tools
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "tools": listed}, *messages[1:]], None
        return [{"role": "system", "content": "", "tools": listed}, *messages], None

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def parse(self, text: str, names: set[str]) -> tuple[str, list[Call]]:
        """(the text that is not a call, the calls): calls to unknown tools or with arguments that
        are not a JSON object stay text, as vLLM's parsers leave them."""
        if self.open:  # the marker, then one JSON list of every call
            at = text.find(self.marker)
            if at < 0:
                return text, []
            body = text[at + len(self.marker):].strip()
            try:
                listed = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            listed = listed if isinstance(listed, list) else [listed]
            calls = [self._call(json.dumps(c), names) for c in listed]
            if not calls or any(c is None for c in calls):
                return text, []
            return text[:at].strip(), calls
        if self.marker:
            calls, kept, at = [], [], 0
            for m in re.finditer(re.escape(self.marker) + r"\s*(\{.*?\})\s*(?:" + re.escape(self.suffix.strip()) +
                                 r"|$)", text, flags=re.DOTALL):
                call = self._call(m.group(1), names)
                if call is None:
                    continue
                kept.append(text[at:m.start()])
                at = m.end()
                calls.append(call)
            kept.append(text[at:])
            return "".join(kept).strip() if calls else text, calls
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [self._call(piece, names) for piece in _json_objects(body)]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", calls

    def _call(self, raw: str, names: set[str]) -> Call | None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        return Call(obj["name"], json.dumps(args, ensure_ascii=False), self.new_id())

    def may_start(self, text: str) -> int:
        """Where in `text` a call may begin (len(text) when none may): streamed text stops there."""
        if not self.marker:
            stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
            return 0 if not stripped or stripped.startswith("{") or "<|python_tag|>".startswith(text.strip()) \
                else len(text)
        at = text.find(self.marker)
        if at >= 0:
            return at
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):  # the marker's start at the end
            if text.endswith(self.marker[:n]):
                return len(text) - n
        return len(text)


FORMATS = {
    "tagged": ToolFormat("tagged", "<tool_call>", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", True),
    "bare-json": ToolFormat("bare-json", "", "parameters", "", "", "; ", False),
    "marked-list": ToolFormat("marked-list", "[TOOL_CALLS]", "arguments", "", "", ", ", True, open="[", close="]",
                          short_ids=True),
    "functools": ToolFormat("functools", "functools", "arguments", "", "", ", ", True, open="[", close="]",
                            tools_in_system=True),
}


def format_for(template: str | None) -> ToolFormat | None:
    """The call format a chat template writes, or None when it writes none Linnet reads."""
    if not template:
        return None
    if "<tool_call>" in template:
        return FORMATS["tagged"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["marked-list"]
    if "<|tool|>" in template and "tools" in template:
        return FORMATS["functools"]
    if '"parameters"' in template and "ipython" in template:
        return FORMATS["bare-json"]
    return None


def _json_objects(text: str) -> list[str]:
    """Top-level JSON objects in `text`, separated by `;`, commas or space."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return out + [text[at:]]  # not JSON: the caller keeps the text
        out.append(text[at:end])
        at = end
    return out


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # OpenAI's, as given (the template renders them)
    choice: str  # "none", "auto", "required" or a function's name
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def grammar(self, fmt: ToolFormat, lead: list[int] = ()) -> GrammarSpec | None:
        """For `required` and a named function: the grammar every answer must follow (after the
        `lead` token ids: the format's marker where it is one special token)."""
        if self.choice in ("none", "auto"):
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     fmt.args_key: t["function"].get("parameters") or {"type": "object"}},
                    "required": ["name", fmt.args_key], "additionalProperties": False} for t in chosen]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        most = MAX_PARALLEL if self.parallel and fmt.parallel else 1
        return GrammarSpec("tool_calls", json.dumps({
            "schema": schema, "prefix": fmt.prefix, "suffix": fmt.suffix, "separator": fmt.separator, "most": most,
            "open": (fmt.marker if fmt.open and not lead else "") + fmt.open, "close": fmt.close, "lead": list(lead)}))


def tool_request(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` checked; None when the request has no tools
    (or `tool_choice` is "none", which renders no tools either)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise FieldError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"])):
            raise FieldError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a "
                             "name of 1 to 64 letters, digits, '_', '.' or '-'", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = {t["function"]["name"] for t in tools}
    if len(names) != len(tools):
        raise FieldError("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise FieldError(f"'tool_choice' names no function in 'tools' ({str(name)[:64]!r})", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise FieldError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise FieldError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return None if choice == "none" else ToolRequest(tools, choice, parallel)


class CallStream:
    """A streamed answer that may hold calls: `push` returns the text that is surely content (what
    comes before a possible call's start), `finish` the rest as content and calls."""

    def __init__(self, fmt: ToolFormat, names: set[str]):
        self.fmt, self.names = fmt, names
        self.sent, self.held = "", ""

    def push(self, text: str) -> str:
        self.held += text
        cut = self.fmt.may_start(self.sent + self.held) - len(self.sent)
        if cut <= 0:
            return ""
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[Call]]:
        content, calls = self.fmt.parse(self.sent + self.held, self.names)
        if not calls:
            return self.held, []
        rest = content[len(self.sent.strip()):] if content.startswith(self.sent.strip()) else ""
        return rest, calls
