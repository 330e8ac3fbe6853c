"""Real clients against ``banyan serve`` (demo model): the OpenAI SDK's ``responses.create`` (sync and
streamed), LangChain's ``ChatOpenAI(use_responses_api=True)``, and guidellm's short streaming
benchmark (20 requests: TTFT and ITL reported, none failed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import openai
import pytest

from tests.support import Server

MODEL = "banyan-demo"
RESPONSE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("openai_clients") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _chat_text(client, messages, n: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_responses_create_is_the_chat_answer(client):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Tell me about rivers",
                                max_output_tokens=8, temperature=0)
    text, finish = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Tell me about rivers"}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.instructions == "Be brief."


def test_responses_message_items_and_stream_events(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Colour of the sky?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "And grass?"}]
    plain = client.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0)
    events = list(client.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == RESPONSE_EVENTS and types[-4:-1] == CLOSING_EVENTS, types
    assert types[-1] in ("response.completed", "response.incomplete") and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    text, _ = _chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                  {"role": "user", "content": "Colour of the sky?"},
                                  {"role": "assistant", "content": "Blue."},
                                  {"role": "user", "content": "And grass?"}], 6)
    assert plain.output_text == text


def test_responses_json_schema_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A number", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["n"], int)
    else:  # (cut by max_output_tokens: a prefix of the grammar)
        assert r.output_text.startswith("{")


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"max_output_tokens": "8"}, "max_output_tokens", "valid integer"),
])
def test_responses_refusals_name_the_field(client, extra, param, words):
    body = {"input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=body.pop("input"), extra_body=body)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_langchain_responses_mode(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.http_url + "/v1", api_key="none", use_responses_api=True,
                     max_tokens=8, temperature=0, max_retries=0)
    msg = llm.invoke([("system", "Be brief."), ("human", "Hello there")])
    assert msg.text and msg.usage_metadata["output_tokens"] > 0
    assert msg.response_metadata["id"].startswith("resp_")
    streamed = list(llm.stream([("system", "Be brief."), ("human", "Hello there")]))
    assert len(streamed) > 1 and "".join(c.text for c in streamed) == msg.text


def test_guidellm_streaming_benchmark(server, demo_dir, tmp_path):
    out = tmp_path / "guidellm.json"
    cmd = ["guidellm", "run",
           "--backend", f"kind=openai_http,target={server.http_url},model={MODEL},request_format=/v1/chat/completions",
           "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=20",
           "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
           "--tokenizer", f"kind=hf_auto,model={demo_dir}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    metrics = json.loads(Path(out).read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 20, "errored": 0, "incomplete": 0, "total": 20}
    for name in ("time_to_first_token_ms", "inter_token_latency_ms"):
        stats = metrics[name]["successful"]
        assert stats["count"] > 0 and stats["mean"] > 0, (name, stats)
    assert "TTFT" in run.stdout and "ITL" in run.stdout


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
             "tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}]


def _calls(r) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_tools(client, choice):
    """tool_choice required / named is grammar-enforced: even the random demo model's calls parse; streamed
    events build the same calls."""
    import jsonschema

    kw = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice=choice, max_output_tokens=120,
              temperature=0, parallel_tool_calls=False)
    r = client.responses.create(**kw)
    calls = _calls(r)
    assert r.status == "completed" and len(calls) == 1, r.output
    name, args = calls[0]
    assert name == "get_weather" or choice == "required"
    if name == "get_weather":
        jsonschema.validate(args, WEATHER)
    events = list(client.responses.create(**kw, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [a.name for a in added] == [name] and json.loads(deltas) == args == json.loads(done[0].arguments)
    assert _calls(events[-1].response) == calls
    assert r.output[-1].call_id.startswith("call_")


def test_responses_tool_result_round_trip(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = next(o for o in first.output if o.type == "function_call")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    second = client.responses.create(model=MODEL, input=history, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=6, temperature=0)
    assert second.output[0].type == "message" and not _calls(second)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"type": "function_call", "name": "f"}], max_output_tokens=2)
    assert e.value.body["param"] == "input.0.call_id"


def test_langchain_responses_mode_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=server.http_url + "/v1", api_key="none", use_responses_api=True,
                     max_tokens=120, temperature=0, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert set(msg.tool_calls[0]["args"]) == {"city", "days"}
