"""`@function_tool`: a plain Python function as a tool, its schema read from the signature and docstring.

As in verl (`verl.tools.function_tool`): the function needs a type hint on every
parameter and a Google-style docstring with an `Args:` block (transformers'
`get_json_schema` builds the OpenAI schema from them and raises at decoration time if one
is missing). `actor_rollout_ref.rollout.multi_turn.function_tool_path` names a Python
file of such functions; it is executed once per process.

A function tool is stateless (no create/release, `tools_kwargs` do not reach it). It may
return a str, a dict (sent as JSON), a ToolResponse, or a tuple (response[, reward[, metrics]]).
A plain (non-async) function runs in its own daemon thread, so a slow one never blocks
the event loop and a hung one never blocks exit. At most `MAX_RUNNING_FUNCTION_CALLS` such
threads live in a process (a call waits for one; the wait is queueing, not the call's time).
A call the agent loop times out is stopped: `ToolCallStopped` is raised in its thread, which
ends Python code at its next line. A thread blocked inside C (a sleep, a lock, a socket)
ends when that call returns; until then it holds its slot, so hung calls cannot pile up.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import inspect
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Union

from verl_async.tools.queueing import queued
from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)

MAX_RUNNING_FUNCTION_CALLS = 8  # threads running sync function tools, per process
_THREAD_SLOTS = threading.BoundedSemaphore(MAX_RUNNING_FUNCTION_CALLS)
_SLOT_POLL_S = 0.02


class ToolCallStopped(Exception):
    """Raised inside a function tool's thread when the agent loop gave up on the call."""


def stop_thread(thread: threading.Thread) -> bool:
    """Raise ToolCallStopped in `thread` at its next Python line; False if it is gone."""
    if thread.ident is None or not thread.is_alive():
        return False
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(ToolCallStopped)) == 1

FUNCTION_TOOL_REGISTRY: dict[str, "FunctionTool"] = {}
_LOADED_PATHS: dict[str, list["FunctionTool"]] = {}


@dataclass
class FunctionTool:
    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        """The function's return value for the model's arguments."""
        if self.is_async:
            return await self.fn(**parameters)
        return await run_in_daemon_thread(self.fn, **parameters)


async def run_in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a fresh daemon thread, once one of the process's thread slots is free.

    Cancelling the await stops the thread (`stop_thread`). Not asyncio.to_thread: its pool
    threads are joined at interpreter exit, so one hung tool would hang the process's end.
    """
    async with queued():
        while not _THREAD_SLOTS.acquire(blocking=False):
            await asyncio.sleep(_SLOT_POLL_S)
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def report(ok: bool, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    def body() -> None:
        try:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                report(False, exc)
            else:
                report(True, result)
        except ToolCallStopped:  # arrived after the function returned: nothing left to stop
            pass
        finally:
            _THREAD_SLOTS.release()

    thread = threading.Thread(target=body, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    try:
        thread.start()
    except BaseException:
        _THREAD_SLOTS.release()
        raise
    try:
        return await future
    except asyncio.CancelledError:
        stop_thread(thread)
        raise


def function_tool(name: Union[str, Callable, None] = None, *,
                  schema: Union[OpenAIFunctionToolSchema, dict, None] = None):
    """Register a function as a tool: `@function_tool`, `@function_tool("other_name")`, or `schema=` to skip inference."""

    def register(fn: Callable) -> Callable:
        tool_name = name if isinstance(name, str) else fn.__name__
        if isinstance(schema, OpenAIFunctionToolSchema):
            built = schema
        elif isinstance(schema, dict):
            built = OpenAIFunctionToolSchema.model_validate(schema)
        else:
            built = schema_from_function(fn, tool_name)
        existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"function tool {tool_name!r} is already registered to "
                             f"{existing.fn.__module__}.{existing.fn.__qualname__}; refusing to replace it with "
                             f"{fn.__module__}.{fn.__qualname__}")
        FUNCTION_TOOL_REGISTRY[tool_name] = FunctionTool(tool_name, fn, built, inspect.iscoroutinefunction(fn))
        return fn

    if callable(name):  # bare @function_tool
        return register(name)
    return register


def schema_from_function(fn: Callable, tool_name: str) -> OpenAIFunctionToolSchema:
    """The OpenAI schema of `fn` (transformers' get_json_schema), named `tool_name`."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool {tool_name!r}: *args/**kwargs ({', '.join(variadic)}) cannot be "
                         "described to the model; use named parameters")
    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return OpenAIFunctionToolSchema.model_validate(raw)


def get_function_tool(name: str) -> FunctionTool:
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(f"function tool {name!r} is not registered (is its file named by multi_turn.function_tool_path?)")
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Execute the file once per process and return the tools it registered (FileNotFoundError if missing)."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no such file: {path}")
    if full in _LOADED_PATHS:
        return _LOADED_PATHS[full]
    before = set(FUNCTION_TOOL_REGISTRY)
    module_name = "_verl_async_function_tools_" + "".join(c if c.isalnum() else "_" for c in full)
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets the file import its siblings' names through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        for added in set(FUNCTION_TOOL_REGISTRY) - before:
            FUNCTION_TOOL_REGISTRY.pop(added)
        raise
    names = sorted(set(FUNCTION_TOOL_REGISTRY) - before)
    if not names:
        logger.warning("%s defines no @function_tool function", path)
    tools = [FUNCTION_TOOL_REGISTRY[n] for n in names]
    _LOADED_PATHS[full] = tools
    return tools


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function's return value as (ToolResponse, reward, metrics); a tuple of 0 or > 3 items is a bug (TypeError)."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"a @function_tool returned a tuple of {len(ret)} items; expected (response,), "
                            "(response, reward) or (response, reward, metrics)")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return as_tool_response(ret[0]), reward, metrics
    return as_tool_response(ret), 0.0, {}


def as_tool_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))
