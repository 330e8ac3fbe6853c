"""Tool calling and reasoning output through ``banyan serve`` with the official ``openai`` client:
``tool_choice`` required / named on the random demo model (grammar-enforced: its calls always
parse), ``auto`` on a scripted model whose greedy output is two Hermes calls after some prose,
the reasoning split on a scripted model with the Qwen3 tokenizer's template; streamed deltas that
concatenate to the non-streamed answer, tool turns in the history, the 400s."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest
import transformers

from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
from tests.scripted_model import make_scripted_model
from tests.support import ROOT, Server

MODEL_ARGS = dict(temperature=0.0, max_tokens=160)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPT = ["Let me check.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": ', '{"city": ', '"Paris", ',
          '"days": ', '3}}', "\n</tool_call>\n<tool_call>\n", '{"name": "get_time", "arguments": {"tz": "UTC"}}',
          "\n</tool_call>"]
THINK = ["<think>", "\nThe user wants the weather.\n", "</think>", "\n\n", "It is sunny.", "<tool_call>",
         '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n', "</tool_call>"]


def shared_assets() -> Path:
    for base in (ROOT.parent / "shared", Path("/work/shared")):
        if (base / "assets").is_dir():
            return base / "assets"
    raise FileNotFoundError("the team's shared/assets folder (tokenizers) is not beside the repository")


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("tools-demo") / "server.log")
    yield openai_client(s)
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def scripted_server(demo_dir, tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("scripted-model"), demo_dir, SCRIPT)
    s = Server(str(model), tmp_path_factory.mktemp("tools-scripted") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def scripted(scripted_server):
    return openai_client(scripted_server)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("thinking-model"), shared_assets() / "tokenizers" / "qwen3",
                                THINK)
    s = Server(str(model), tmp_path_factory.mktemp("tools-thinking") / "server.log", "--reasoning-parser", "qwen3")
    yield openai_client(s)
    assert s.stop() == 0, s.log_text()[-3000:]


def streamed(client: openai.OpenAI, **kw) -> dict:
    """A streamed chat's choice 0 put together as the SDK's users do; checks the deltas' shape."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        finish = c.finish_reason or finish
        if d.content:
            assert "<tool_call>" not in d.content and "</tool_call>" not in d.content, d.content
            content.append(d.content)
        rc = getattr(d, "reasoning_content", None)
        if rc:
            assert "<think>" not in rc and "</think>" not in rc
            reasoning.append(rc)
        for t in d.tool_calls or ():
            if t.index not in calls:
                assert t.id and t.type == "function" and t.function.name, "a call's first delta: id, type, name"
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": [t.function.arguments or ""]}
            else:
                assert t.id is None and t.function.name is None, "id and name come once"
                calls[t.index]["arguments"].append(t.function.arguments or "")
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None, "finish": finish,
            "calls": [(calls[i]["name"], "".join(calls[i]["arguments"])) for i in sorted(calls)]}


def whole(client: openai.OpenAI, **kw) -> dict:
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    return {"content": m.content or None, "reasoning": getattr(m, "reasoning_content", None),
            "finish": r.choices[0].finish_reason,
            "calls": [(t.function.name, t.function.arguments) for t in m.tool_calls or ()],
            "ids": [t.id for t in m.tool_calls or ()], "usage": r.usage}


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls, "no tool call"
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


# ---- the random demo model: tool_choice enforced by the grammar ----

def test_required_calls_always_parse_and_stream_the_same(demo):
    kw = dict(model="banyan-demo", messages=ASK, tools=TOOLS, tool_choice="required", **MODEL_ARGS)
    a = whole(demo, **kw)
    assert a["finish"] == "tool_calls" and a["content"] is None
    check_calls(a["calls"])
    assert all(i.startswith("call_") for i in a["ids"]) and len(set(a["ids"])) == len(a["ids"])
    b = streamed(demo, **kw)
    assert (b["calls"], b["content"], b["finish"]) == (a["calls"], a["content"], a["finish"])
    for seed in range(3):  # sampled too
        check_calls(whole(demo, **{**kw, "temperature": 1.0, "seed": seed})["calls"])


def test_named_function_and_no_parallel_calls(demo):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        a = whole(demo, model="banyan-demo", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
                  seed=seed, max_tokens=160)
        assert [n for n, _ in a["calls"]] == ["get_time"] and a["finish"] == "tool_calls"
        check_calls(a["calls"])
        one = whole(demo, model="banyan-demo", messages=ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=160)
        assert len(one["calls"]) == 1
        check_calls(one["calls"])


def test_no_tools_or_none_is_plain_chat(demo):
    for kw in (dict(tools=[]), dict(tools=TOOLS, tool_choice="none"), dict(tools=None)):
        a = whole(demo, model="banyan-demo", messages=ASK, max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True}, **{k: v for k, v in kw.items() if v is not None})
        assert a["calls"] == [] and a["finish"] == "length" and a["content"]


def test_tool_result_round_trip_renders_the_history(demo, demo_dir):
    first = demo.chat.completions.create(model="banyan-demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                         **MODEL_ARGS)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    r = demo.chat.completions.create(model="banyan-demo", messages=history, tools=TOOLS, max_tokens=4,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    msgs = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    rendered = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in rendered and call.function.name in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("kw,needle", [
    (dict(tool_choice="required"), "tool_choice required needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "given twice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(messages=ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs.tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(demo, kw, needle):
    with pytest.raises(openai.BadRequestError) as e:
        demo.chat.completions.create(**{"model": "banyan-demo", "messages": ASK, "max_tokens": 4, **kw})
    assert needle in e.value.message


# ---- a model that writes calls itself: tool_choice auto ----

def test_auto_parses_prose_and_parallel_calls_streamed_and_not(scripted):
    kw = dict(model="banyan-demo", messages=ASK, tools=TOOLS, **MODEL_ARGS)
    kw["model"] = scripted.models.list().data[0].id
    a = whole(scripted, **kw)
    assert a["content"] == "Let me check." and a["finish"] == "tool_calls"
    assert [(n, json.loads(x)) for n, x in a["calls"]] == [("get_weather", {"city": "Paris", "days": 3}),
                                                            ("get_time", {"tz": "UTC"})]
    b = streamed(scripted, **kw)
    assert (b["content"], b["calls"], b["finish"]) == (a["content"], a["calls"], a["finish"])
    # strict functions keep their schema under auto: a grammar triggered at <tool_call> (its jump-forward
    # text is tokenized anew, which throws this bigram model off its script: the calls differ, still valid)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    s = whole(scripted, **{**kw, "tools": strict})
    assert s["content"] == "Let me check." and s["finish"] == "tool_calls"
    check_calls(s["calls"])
    # none: the same model's text is content, not parsed
    n = whole(scripted, **{**kw, "tool_choice": "none"})
    assert n["calls"] == [] and n["finish"] == "stop" and n["content"] is not None


def test_grpc_generate_with_tools(scripted_server, scripted):
    """banyan.v1: the same calls as HTTP's, as ToolCallDelta pieces; text holds only the prose."""
    want = whole(scripted, model=scripted.models.list().data[0].id, messages=ASK, tools=TOOLS, **MODEL_ARGS)
    tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])]),
                             tools=tools, sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=160))
    with scripted_server.channel() as ch:
        resps = list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=60))
        calls: dict[int, list[str]] = {}
        for r in resps:
            for t in r.tool_calls:
                if t.index not in calls:
                    assert t.id.startswith("call_") and t.name
                    calls[t.index] = [t.name, ""]
                calls[t.index][1] += t.arguments
        assert "".join(r.text for r in resps) == want["content"]
        assert [tuple(calls[i]) for i in sorted(calls)] == want["calls"]
        assert resps[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
        # a history with a call and its result renders (arguments must be JSON)
        hist = [pb.ChatMessage(role="user", content="hi"),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_time", arguments="{x")])]
        bad = pb.GenerateRequest(chat=pb.ChatInput(messages=hist), tools=tools)
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(ch).Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.messages[1].tool_calls[0].function.arguments" in e.value.details()


# ---- reasoning: the Qwen3 tokenizer's template, a model that thinks first ----

def test_reasoning_split_streamed_and_not_then_the_call(thinking):
    name = thinking.models.list().data[0].id
    kw = dict(model=name, messages=ASK, tools=TOOLS, **MODEL_ARGS)
    a = whole(thinking, **kw)
    assert a["reasoning"] == "\nThe user wants the weather.\n" and a["content"] == "It is sunny."
    assert [(n, json.loads(x)) for n, x in a["calls"]] == [("get_weather", {"city": "Paris", "days": 1})]
    b = streamed(thinking, **kw)
    assert (b["reasoning"], b["content"], b["calls"], b["finish"]) == (a["reasoning"], a["content"], a["calls"],
                                                                       a["finish"])
    raw = thinking.chat.completions.create(**kw).model_dump()["choices"][0]["message"]
    assert raw["reasoning"] == raw["reasoning_content"]  # (the newer name too)
    # chat_template_kwargs reach the template: Qwen3 without thinking starts after an empty block
    off = whole(thinking, **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off["reasoning"] is None and off["content"] == "It is sunny." and off["calls"] == a["calls"]


# ---- the clients agents use, against the random demo model (grammar-enforced calls) ----

class Forecast(pydantic.BaseModel):
    """The weather forecast to fetch."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


def test_langchain_bind_tools_and_structured_output(demo):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_forecast(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """Fetch the weather forecast of a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=str(demo.base_url), api_key="none", model="banyan-demo", temperature=0.0,
                     max_tokens=160, max_retries=0)
    msg = llm.bind_tools([get_forecast], tool_choice="required").invoke("Weather in Paris?")
    assert [c["name"] for c in msg.tool_calls][:1] == ["get_forecast"] and msg.tool_calls[0]["id"]
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome", "Oslo")
    out = llm.with_structured_output(Forecast, method="function_calling").invoke("Weather in Rome for 3 days?")
    assert isinstance(out, Forecast)


def test_instructor_tools_mode(demo):
    import instructor

    client = instructor.from_openai(demo, mode=instructor.Mode.TOOLS)
    out = client.chat.completions.create(model="banyan-demo", response_model=Forecast, max_retries=0,
                                         messages=ASK, temperature=0.0, max_tokens=160)
    assert isinstance(out, Forecast)


def test_litellm_tools(demo, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (litellm's own: no fetch of its price list)
    import litellm

    r = litellm.completion(model="openai/banyan-demo", api_base=str(demo.base_url), api_key="none", messages=ASK,
                           tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=160)
    calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    check_calls(calls)
    assert r.choices[0].finish_reason == "tool_calls"


NODE_OPENAI = "openai@7.60.0"


@pytest.fixture(scope="module")
def node_openai(tmp_path_factory) -> Path:
    """The official Node SDK, installed from the npm registry into a folder of the test run."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    d = tmp_path_factory.mktemp("node-openai")
    r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", NODE_OPENAI], cwd=d,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"the npm registry did not give {NODE_OPENAI}: {r.stderr[-500:]}")
    shutil.copy(Path(__file__).parent / "node" / "tool_stream.mjs", d / "tool_stream.mjs")
    return d


def test_node_sdk_streams_the_same_calls(scripted, node_openai):
    model = scripted.models.list().data[0].id
    want = whole(scripted, model=model, messages=ASK, tools=TOOLS, **MODEL_ARGS)
    r = subprocess.run(["node", "tool_stream.mjs", str(scripted.base_url), model, json.dumps(TOOLS), json.dumps(ASK)],
                       cwd=node_openai, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["content"] == want["content"] and got["finish"] == "tool_calls"
    assert [tuple(c) for c in got["calls"]] == want["calls"]
