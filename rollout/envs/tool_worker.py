"""The tool worker process: load the tool callables once, then serve calls until told to stop.

A tool is a plain Python function called with keyword arguments (the model's tool call's
`arguments`); what it returns becomes text (str as is, anything else as JSON) and what it raises
becomes an error the model reads. Its schema for the chat template comes from its signature and
docstring. Kept light on imports: with forkserver this module is preloaded once.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable

import msgspec

from streamrl.engine.messages import ToolCall, ToolFromWorker, ToolReady, ToolResult, ToolSchema, ToolStop, ToolToWorker
from streamrl.engine.workers.child import serve
from streamrl.rollout.envs.protocol import load_object

BUILTIN_TOOLS = {"calculator": "streamrl.rollout.envs.calculator:calculator"}
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToolToWorker)
_from_worker = msgspec.msgpack.Decoder(ToolFromWorker)


def load_tools(specs: list[str]) -> dict[str, Callable]:
    """Tool callables by name (their `__name__`); raises `SpecError` naming the spec."""
    tools = {}
    for spec in specs:
        fn = load_object(spec, "env.tools", BUILTIN_TOOLS)
        tools[fn.__name__] = fn
    return tools


def schema(fn: Callable) -> ToolSchema:
    """The function's schema: its name, its docstring's first paragraph, one parameter per argument."""
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        hint = param.annotation if param.annotation is not param.empty else str
        properties[name] = {"type": _JSON_TYPES.get(_base(hint), "string")}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return ToolSchema(
        name=fn.__name__,
        description=doc.split("\n\n")[0].replace("\n", " "),
        parameters={"type": "object", "properties": properties, "required": required},
    )


def _base(hint):
    if isinstance(hint, str):  # postponed annotations
        return {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}.get(hint, str)
    return hint


def main(conn, specs: list[str]) -> None:
    """Entry point of a worker; `conn` is its end of the pipe to the pool (`engine/workers/child.py`)."""

    def setup():
        tools = load_tools(specs)
        return (lambda call: _serve(tools, call)), {"tools": [schema(fn) for fn in tools.values()]}

    serve(conn, setup, ToolReady, _to_worker, ToolStop)


def _serve(tools: dict[str, Callable], call: ToolCall) -> ToolResult:
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(call_id=call.call_id, error=f"no tool named {call.name!r}; tools: {', '.join(tools)}")
    try:
        out = fn(**call.arguments)
    except Exception as e:  # noqa: BLE001 - the model reads what went wrong
        return ToolResult(call_id=call.call_id, error=f"{type(e).__name__}: {e}")
    text = out if isinstance(out, str) else json.dumps(out, default=str)
    return ToolResult(call_id=call.call_id, output=text)


def encode(message: ToolCall | ToolStop) -> bytes:
    return _encoder.encode(message)


def decode_reply(frame: bytes) -> ToolReady | ToolResult:
    return _from_worker.decode(frame)
