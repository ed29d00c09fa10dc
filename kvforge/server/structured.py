"""Structured output in the chat API: `response_format` (json_object, json_schema) and OpenAI `tools` / `tool_choice`.

Each becomes a grammar for the engine (`SamplingParams.structured_outputs`, engine/grammar.py) and, for tools, a
system message that lists the functions and asks for a call as {"name": ..., "arguments": {...}}:
- tool_choice "required": the output is a call of one of the tools (grammar: anyOf over the tools' parameter schemas,
  closed to the properties they name unless they set additionalProperties);
- a named function ({"type": "function", "function": {"name": N}}): a call of N;
- "auto" (the default with tools): no grammar, the model chooses; a reply that is such a call becomes `tool_calls`;
- "none": the tools are not offered.
A reply that is a call comes back in OpenAI's `tool_calls` shape with finish_reason "tool_calls"; one call per
reply (parallel_tool_calls is accepted, and a reply holds at most one call).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvforge.server.errors import bad_request

TOOL_PROMPT = ("You can call these functions. To call one, reply with only a JSON object "
               '{{"name": <function name>, "arguments": <its arguments as an object>}} and nothing else; '
               "otherwise answer normally.\nFunctions:\n{functions}")


@dataclass
class OutputPlan:
    grammar: dict | None = None  # SamplingParams.structured_outputs
    tools: dict[str, dict] = field(default_factory=dict)  # name -> its "function" object, when offered
    tool_mode: str | None = None  # "auto" | "required" | "named"; None: no tools offered


def plan_output(req) -> OutputPlan:
    """What a chat request asks of its output; a 400 for what this server cannot do."""
    plan = OutputPlan(grammar=_response_format(req.response_format))
    if req.functions or req.function_call not in (None, "none"):
        raise bad_request("functions / function_call (the deprecated API) are not supported; use tools and "
                          "tool_choice", "functions")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if not req.tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return plan
    plan.tools = _functions(req.tools)
    if choice == "none":
        plan.tools = {}
        return plan
    if plan.grammar is not None and choice != "auto":
        raise bad_request("response_format and a forced tool call (tool_choice required or named) exclude each "
                          "other; send one of them", "tool_choice")
    if choice == "auto":
        plan.tool_mode = "auto"
    elif choice == "required":
        plan.tool_mode, plan.grammar = "required", {"json": _call_schema(list(plan.tools.values()))}
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in plan.tools:
            raise bad_request(f"tool_choice names function {name!r}, which is not among tools "
                              f"({', '.join(plan.tools)})", "tool_choice")
        plan.tool_mode, plan.grammar = "named", {"json": _call_schema([plan.tools[name]])}
    else:
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {choice!r}", "tool_choice")
    return plan


def _response_format(rf: dict | None) -> dict | None:
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              "response_format")
        return {"json": spec.get("schema") or {"type": "object"}}
    raise bad_request(f"response_format type {kind!r} is not supported; allowed: text, json_object, json_schema",
                      "response_format")


def _functions(tools: list[dict]) -> dict[str, dict]:
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              "{...}}}}", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[fn["name"]] = fn
    return out


def _call_schema(functions: list[dict]) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": _closed(fn)},
              "required": ["name", "arguments"], "additionalProperties": False} for fn in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _closed(fn: dict) -> dict:
    """A function's parameters with no properties beyond those it names, unless it says otherwise (as OpenAI's strict
    function calling requires): a small model otherwise keeps inventing keys until max_tokens."""
    params = dict(fn.get("parameters") or {"type": "object"})
    if "properties" in params and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return params


def tool_messages(messages: list[dict], plan: OutputPlan) -> list[dict]:
    """The chat messages with the offered tools described in the (first) system message."""
    if not plan.tool_mode:
        return messages
    listing = "\n".join(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                    "parameters": fn.get("parameters", {})}) for fn in plan.tools.values())
    text = TOOL_PROMPT.format(functions=listing)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def tool_calls(text: str, plan: OutputPlan) -> list[dict] | None:
    """OpenAI tool_calls when the reply is a call of an offered function, else None (a plain answer)."""
    if not plan.tool_mode:
        return None
    body = text.strip()
    if body.startswith("<tool_call>") and body.endswith("</tool_call>"):  # Hermes-style templates
        body = body[len("<tool_call>"):-len("</tool_call>")].strip()
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in plan.tools or not isinstance(call.get("arguments"), dict):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]


def message_dict(m) -> dict:
    """A request message as the chat template sees it: an assistant's tool calls as the JSON it would have written,
    a tool result as its content."""
    if m.role == "assistant" and m.tool_calls:
        calls = [{"name": c.get("function", {}).get("name"), "arguments": _arguments(c)} for c in m.tool_calls]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    return {"role": m.role, "content": m.text()}


def _arguments(call: dict):
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
