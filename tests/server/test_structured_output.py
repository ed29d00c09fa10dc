"""Structured output and tool calls through a real server (uvicorn on a socket), with the official `openai` client
and with LangChain (`langchain-openai`: with_structured_output and bind_tools, invoked, streamed and async)."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvforge.server.structured import OutputPlan, tool_calls

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                        "required": ["zone"]}}}
ASK_CITY = [{"role": "user", "content": "Name a big city and its population."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_response_format(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK_CITY, temperature=0, max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "city", "schema": CITY, "strict": True}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_response_format_streamed(client, model_name):
    chunks = list(client.chat.completions.create(model=model_name, messages=ASK_CITY, temperature=0, max_tokens=60,
                                                 response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_comes_back_as_tool_calls(client, model_name, choice):
    r = client.chat.completions.create(model=model_name, messages=ASK_WEATHER, temperature=0, max_tokens=60,
                                       tools=[TIME, WEATHER] if choice == "required" else [WEATHER], tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})


def test_named_tool_call_streamed(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=ASK_WEATHER, temperature=0, max_tokens=60, tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True))
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_time"
    assert "zone" in json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK_WEATHER, temperature=0, max_tokens=12,
                                       tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_reads_a_call_only_when_the_reply_is_one():
    plan = OutputPlan(tools={"get_weather": WEATHER["function"]}, tool_mode="auto")
    (call,) = tool_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}', plan)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_calls('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', plan)
    assert tool_calls("It is sunny in Paris.", plan) is None
    assert tool_calls('{"name": "get_time", "arguments": {}}', plan) is None  # not offered
    assert tool_calls('{"name": "get_weather", "arguments": {}}', OutputPlan()) is None  # no tools offered


def test_a_bad_schema_fails_alone(client, model_name):
    def good():
        return client.chat.completions.create(model=model_name, messages=ASK_CITY, temperature=0, max_tokens=60,
                                              response_format={"type": "json_schema",
                                                               "json_schema": {"name": "c", "schema": CITY}})

    def bad():
        return client.chat.completions.create(model=model_name, messages=ASK_CITY, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})

    with ThreadPoolExecutor(2) as pool:
        ok, broken = pool.submit(good), pool.submit(bad)
        with pytest.raises(openai.BadRequestError, match="structured output"):
            broken.result()
        assert set(json.loads(ok.result().choices[0].message.content)) == {"city", "population"}


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "regex"}}, "allowed: text, json_object, json_schema"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                              "function": {"name": "g"}}}, "not among"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ({"functions": [{"name": "f"}]}, "deprecated"),
])
def test_what_the_server_cannot_do_is_refused(client, model_name, extra, message):
    with pytest.raises(openai.BadRequestError, match=message.replace("[", r"\[")):
        client.chat.completions.create(model=model_name, messages=ASK_WEATHER, max_tokens=4, **extra)


def test_langchain_structured_output_and_tools(server, model_name):
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        population: int

    class Capital(BaseModel):
        country: str
        capital: str

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=model_name, temperature=0, max_tokens=60,
                     max_retries=0)
    city = llm.with_structured_output(City).invoke("Name a big city and its population.")
    assert isinstance(city, City) and city.city
    capital = llm.with_structured_output(Capital, method="function_calling").invoke("What is the capital of France?")
    assert isinstance(capital, Capital) and capital.capital
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    asked = bound.invoke("What is the weather in Paris?")
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    streamed = None
    for chunk in bound.stream("What is the weather in Rome?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"] and "city" in streamed.tool_calls[0]["args"]
    later = asyncio.run(bound.ainvoke("What is the weather in Oslo?"))
    assert [c["name"] for c in later.tool_calls] == ["get_weather"]
    answer = llm.bind_tools([get_weather]).invoke(
        ["What is the weather in Paris?", asked, ToolMessage(content="sunny", tool_call_id=call["id"])])
    assert answer.content or answer.tool_calls  # the round trip (tool_calls and a tool result) is accepted
