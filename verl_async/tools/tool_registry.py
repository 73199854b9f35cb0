"""Loading tools from verl's two sources: a tool-config YAML and a Python file of function tools.

The YAML is verl's format:

    tools:
      - class_name: verl_async.tools.calculator.CalculatorTool   # module.Class, a BaseTool
        config: {type: native, ...}                              # handed to the class
        tool_schema: {type: function, function: {name, description, parameters}}   # optional

verl's own class paths that have a counterpart here are read as it (`VERL_TOOL_CLASSES`), so a
verl tool config naming `verl.tools.sandbox_fusion_tools.SandboxFusionTool` works unchanged.

Problems raise ToolLoadError naming the config key (`tool_config_path` or
`function_tool_path`), the file and the entry; config validation turns it into the one
ConfigError line (verl_async/config/multi_turn.py).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from verl_async.tools.base_tool import BaseTool
from verl_async.tools.function_tool import FunctionTool, load_function_tools_from_path
from verl_async.tools.schemas import OpenAIFunctionToolSchema

Tool = Union[BaseTool, FunctionTool]
TOOL_TYPES = ("native",)  # verl removed its MCP type too


class ToolLoadError(ValueError):
    """`key` is the multi_turn key whose file is at fault ("tool_config_path" or "function_tool_path")."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


@dataclass
class ToolSpec:
    """One YAML entry, resolved but not built: enough to know the tool's name."""

    where: str  # "<file>: tools[i]"
    cls: type
    config: dict
    schema: Optional[OpenAIFunctionToolSchema]

    def build(self) -> Any:
        return self.cls(config=self.config, tool_schema=self.schema)

    @property
    def name(self) -> str:
        """The schema's function name (a class that brings its own schema is built to ask it)."""
        return self.schema.function.name if self.schema is not None else self.build().name


VERL_TOOL_CLASSES = {  # verl's class path -> ours (same config keys and behaviour)
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "verl_async.tools.sandbox_fusion_tools.SandboxFusionTool",
}


def get_tool_class(class_name: str) -> type:
    """`package.module.Class` -> the class (ImportError/AttributeError as Python raises them)."""
    class_name = VERL_TOOL_CLASSES.get(class_name, class_name)
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise ImportError(f"{class_name!r} is not a module path (expected package.module.Class)")
    return getattr(importlib.import_module(module_name), attr)


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def read_tool_config(path: str) -> list[ToolSpec]:
    """The entries of a tool-config YAML, classes imported and schemas checked (nothing built)."""
    from omegaconf import OmegaConf

    key = "tool_config_path"
    if not os.path.isfile(os.path.expanduser(path)):
        raise ToolLoadError(key, f"no such file: {path}")
    try:
        data = _plain(OmegaConf.load(os.path.expanduser(path)))
    except Exception as exc:  # noqa: BLE001 - YAML and OmegaConf parse errors alike
        raise ToolLoadError(key, f"{path}: not a readable YAML file ({type(exc).__name__}: {exc})") from None
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list):
        raise ToolLoadError(key, f"{path}: expected a mapping with a 'tools' list (verl's tool config format)")
    specs = []
    for i, entry in enumerate(tools):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolLoadError(key, f"{where}: needs a class_name (module.Class)")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind not in TOOL_TYPES:
            raise ToolLoadError(key, f"{where}.config.type: {kind!r} is not supported (expected one of {TOOL_TYPES})")
        try:
            cls = get_tool_class(entry["class_name"])
        except (ImportError, AttributeError) as exc:
            raise ToolLoadError(key, f"{where}.class_name: unknown tool class {entry['class_name']!r} "
                                     f"({type(exc).__name__}: {exc})") from None
        if not isinstance(cls, type) or not callable(getattr(cls, "execute", None)):
            raise ToolLoadError(key, f"{where}.class_name: {entry['class_name']!r} is not a tool class "
                                     "(subclass verl_async.tools.BaseTool)")
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
            except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, shortened
                first = str(exc).splitlines()
                raise ToolLoadError(key, f"{where}.tool_schema: not an OpenAI function schema "
                                         f"({' '.join(first[:3])})") from None
        specs.append(ToolSpec(where, cls, config, schema))
    return specs


def read_function_tools(path: str) -> list[FunctionTool]:
    try:
        return load_function_tools_from_path(path)
    except FileNotFoundError:
        raise ToolLoadError("function_tool_path", f"no such file: {path}") from None
    except Exception as exc:  # noqa: BLE001 - the user's file failed to import
        raise ToolLoadError("function_tool_path", f"{path}: failed to load ({type(exc).__name__}: {exc})") from None


def check_unique_names(named: list[tuple[str, str, str]]) -> None:
    """`named` = (tool name, key, where); a name seen twice raises, naming both places."""
    seen: dict[str, tuple[str, str]] = {}
    for name, key, where in named:
        if name in seen:
            raise ToolLoadError(key, f"duplicate tool name {name!r}: {seen[name][1]} and {where} "
                                     "(each tool name must be unique across tool_config_path and function_tool_path)")
        seen[name] = (key, where)


def tool_names(tool_config_path: Optional[str], function_tool_path: Optional[str]) -> list[str]:
    """The names the model will see; raises ToolLoadError for any problem (config validation calls this)."""
    named = [(s.name, "tool_config_path", s.where) for s in (read_tool_config(tool_config_path) if tool_config_path else [])]
    named += [(t.name, "function_tool_path", f"{function_tool_path}: {t.fn.__name__}")
              for t in (read_function_tools(function_tool_path) if function_tool_path else [])]
    check_unique_names(named)
    return [name for name, _, _ in named]


def load_all_tools(tool_config_path: Optional[str], function_tool_path: Optional[str]) -> dict[str, Tool]:
    """name -> tool: the YAML's tools built, then the file's function tools (verl's `load_all_tools`)."""
    specs = read_tool_config(tool_config_path) if tool_config_path else []
    native = []
    for spec in specs:
        try:
            native.append((spec.build(), spec.where))
        except Exception as exc:  # noqa: BLE001 - the tool's own constructor failed
            raise ToolLoadError("tool_config_path", f"{spec.where}: building {spec.cls.__name__} failed "
                                                    f"({type(exc).__name__}: {exc})") from None
    functions = read_function_tools(function_tool_path) if function_tool_path else []
    named = [(tool.name, "tool_config_path", where) for tool, where in native]
    named += [(t.name, "function_tool_path", f"{function_tool_path}: {t.fn.__name__}") for t in functions]
    check_unique_names(named)
    tools: dict[str, Tool] = {tool.name: tool for tool, _ in native}
    tools.update({t.name: t for t in functions})
    return tools


def schema_dict(tool: Tool) -> dict:
    """A tool's OpenAI schema as the chat template's `tools=` gets it (verl dumps it the same way)."""
    return tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)


def multi_turn_tool_schemas(multi_turn: Any) -> Optional[list[dict]]:
    """The schemas of `actor_rollout_ref.rollout.multi_turn`'s tools, None when multi-turn is off.

    The prompts are rendered with them (the Rollouter's dataset and the preflight's count alike).
    """
    if not multi_turn.enable:
        return None
    return [schema_dict(t) for t in load_all_tools(multi_turn.tool_config_path, multi_turn.function_tool_path).values()]
