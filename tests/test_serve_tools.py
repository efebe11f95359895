"""Tool calls on `linnet serve`: tools rendered by the model's own chat template (Qwen 2.5's and
Llama 3.1's, on the tiny fixtures), calls parsed from the template's format, `required` and named
`tool_choice` held to valid calls by the grammar, streamed as `delta.tool_calls`, tool answers sent
back through the template; through raw HTTP and the official `openai` SDK."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.serve.engine import Engine  # noqa: E402
from linnet_core.serve.http import Limits, Server, create_app  # noqa: E402
from linnet_core.serve.tools import FORMATS, format_for  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402
from server_fixtures import app_in_thread  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"
CACHE = 2560


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    days: int = pydantic.Field(ge=1, le=7)

    model_config = pydantic.ConfigDict(extra="forbid")


class Search(pydantic.BaseModel):
    query: str = pydantic.Field(max_length=16)

    model_config = pydantic.ConfigDict(extra="forbid")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": Search.model_json_schema()}}]
SCHEMAS = {"get_weather": Weather, "search": Search}


def with_template(src: Path, dst: Path, template: str, special: tuple[str, ...] = ()) -> Path:
    """The fixture with a released model's chat template, and its control tokens added as special ones."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (TEMPLATES / template).read_text()
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if special:
        tok = HFTokenizer.from_file(str(dst / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True) for t in special])
        tok.save(str(dst / "tokenizer.json"))
    return dst


MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]")


@pytest.fixture(scope="module", params=[("qwen2-bias-tied", "Qwen-Qwen2.5-7B-Instruct.jinja", ()),
                                        ("llama-llama3-rope", "meta-llama-Llama-3.1-8B-Instruct.jinja", ()),
                                        ("qwen2-bias-tied", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
                                         MISTRAL_CONTROL),
                                        ("phi3-fused-window", "microsoft-Phi-4-mini-instruct.jinja", ())],
                ids=["qwen2.5-template", "llama3.1-template", "mistral-nemo-template", "phi4-mini-template"])
def served(request, tokenized_checkpoints, tmp_path_factory):
    case, template, special = request.param
    path = with_template(tokenized_checkpoints[case], tmp_path_factory.mktemp("tools") / case, template, special)
    session, _ = load_model(path, "torch", "float32", CACHE, rows=2)
    tok = Tokenizer(path)
    app = create_app(Server(Engine(session, tok, prefill_chunk=256), tok, "tiny", Limits(max_tokens=CACHE)))
    with app_in_thread(app) as url:
        yield url, tok


def chat(url, **body):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 1000, "temperature": 0,
            "tools": TOOLS, **body}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    return r.status_code, r.json()


def check_calls(message: dict, names: set[str], most: int) -> list[dict]:
    calls = message["tool_calls"]
    assert 1 <= len(calls) <= most
    for c in calls:
        assert c["type"] == "function" and c["function"]["name"] in names
        assert c["id"].startswith("call_") or len(c["id"]) == 9  # Mistral's templates take 9 letters and digits
        SCHEMAS[c["function"]["name"]].model_validate_json(c["function"]["arguments"])
    return calls


def test_required_calls_are_valid_calls(served):
    url, tok = served
    status, body = chat(url, tool_choice="required")
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    most = 8 if format_for(tok.chat_template).parallel else 1
    check_calls(choice["message"], {"get_weather", "search"}, most)


def test_a_named_function_is_the_call(served):
    url, tok = served
    status, body = chat(url, tool_choice={"type": "function", "function": {"name": "search"}},
                        parallel_tool_calls=False)
    assert status == 200, body
    calls = check_calls(body["choices"][0]["message"], {"search"}, 1)
    assert calls[0]["function"]["name"] == "search"


def test_streamed_calls_reassemble_into_the_whole_answer(served):
    url, tok = served
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 1000, "temperature": 0,
            "tools": TOOLS, "tool_choice": "required", "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for e in events:
        for tc in e["choices"][0]["delta"].get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += tc["function"].get("name") or ""
            entry["arguments"] += tc["function"].get("arguments") or ""
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = chat(url, tool_choice="required")[1]["choices"][0]["message"]["tool_calls"]
    assert [calls[k] for k in sorted(calls)] == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                                 for c in whole]


def test_tool_answers_go_back_through_the_template(served):
    url, tok = served
    call = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abc123XYZ", "content": "18 degrees and sunny"}]
    status, body = chat(url, messages=messages, max_tokens=4, tool_choice="auto")
    assert status == 200, body
    fmt = format_for(tok.chat_template)
    past = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}}
    shown, listed = fmt.place([messages[0], {"role": "assistant", "content": "", "tool_calls": [past]}, messages[2]],
                              TOOLS)
    ids = tok.apply_chat_template(shown, listed)
    rendered = tok.decode(ids)
    assert "18 degrees and sunny" in rendered and "get_weather" in rendered  # the tools, and the tool's answer
    if "tool_calls" in tok.chat_template:  # Phi-4-mini's writes no earlier calls
        assert '"city": "Paris"' in rendered
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_one_400_naming_the_field(served, fields, param):
    url, _ = served
    status, body = chat(url, max_tokens=2, **fields)
    assert status == 400 and body["error"]["param"] == param, body


def test_the_openai_sdk_gets_tool_calls(served):
    openai = pytest.importorskip("openai")
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=1000, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                        tool_choice="required", max_tokens=1000, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls and final.choices[0].finish_reason == "tool_calls"


# -- the parsers alone --------------------------------------------------------------------------
def test_tagged_calls_are_found_among_text():
    fmt, names = FORMATS["tagged"], {"f", "g"}
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = fmt.parse(text, names)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": {"b": 1}}),
                                                                                                  ("g", {})]
    unterminated = '<tool_call>\n{"name": "f", "arguments": {"x": 2}}'  # the answer ended before the close tag
    assert [c.name for c in fmt.parse(unterminated, names)[1]] == ["f"]
    for stays in ('<tool_call>{"name": "h", "arguments": {}}</tool_call>', "<tool_call>{not json}</tool_call>",
                  'plain text {"name": "f"}'):
        assert fmt.parse(stays, names) == (stays, [])


def test_bare_json_calls():
    fmt, names = FORMATS["bare-json"], {"f"}
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse('<|python_tag|>{"name": "f", "parameters": {"q": 1}}',
                                                                 names)[1]] == [("f", {"q": 1})]
    assert fmt.parse('{"name": "f", "parameters": {}}; {"name": "f", "parameters": {"z": 0}}', names)[1][1].arguments \
        == '{"z": 0}'
    assert fmt.parse("The answer is 4.", names) == ("The answer is 4.", [])
    assert fmt.parse('{"name": "other", "parameters": {}}', names)[1] == []


def test_marked_list_calls_follow_their_marker():
    fmt, names = FORMATS["marked-list"], {"f", "g"}
    content, calls = fmt.parse('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                               names)
    assert content == "Sure." and [c.name for c in calls] == ["f", "g"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert fmt.parse('[TOOL_CALLS][{"name": "zz", "arguments": {}}]', names)[1] == []
    assert fmt.parse("no calls here", names) == ("no calls here", [])


def test_functools_calls_and_the_template_that_takes_tools_in_the_system_message():
    fmt, names = FORMATS["functools"], {"f"}
    content, calls = fmt.parse('functools[{"name": "f", "arguments": {"x": 1}}]', names)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    messages, tools = fmt.place([{"role": "user", "content": "Hi"}], TOOLS)
    assert tools is None and messages[0]["role"] == "system"
    assert [t["name"] for t in json.loads(messages[0]["tools"])] == ["get_weather", "search"]
    kept, _ = fmt.place([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS)
    assert kept[0]["content"] == "Be brief." and "tools" in kept[0] and len(kept) == 2


def test_the_format_is_read_off_the_template():
    assert format_for((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()).name == "tagged"
    assert format_for((TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()).name == "bare-json"
    assert format_for((TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()).name == "marked-list"
    assert format_for((TEMPLATES / "microsoft-Phi-4-mini-instruct.jinja").read_text()).name == "functools"
    assert format_for("{{ messages[0].content }}") is None


def test_langchain_binds_tools_and_structures_output(served):
    """LangChain's ChatOpenAI pointed at the server, unchanged: `bind_tools(...).invoke` returns parsed
    tool calls, `with_structured_output(Model).invoke` a validated model."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    url, _ = served
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", temperature=0, max_tokens=1000,
                     max_retries=0)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(message.tool_calls[0]["args"])
    structured = llm.with_structured_output(Search, method="json_schema").invoke("Find something.")
    assert isinstance(structured, Search)
    via_tools = llm.with_structured_output(Search, method="function_calling").invoke("Find something.")
    assert isinstance(via_tools, Search)
