"""Chat's tools: the request's functions and ``tool_choice``, the constraint each choice puts on
the output, and the prompt that shows the model its tools.

``tool_choice``, as vLLM serves it:

- ``"none"``: no call; the tools are not shown to the model (vLLM's
  ``--exclude-tools-when-tool-choice-none``: a model told of tools it may not call calls them);
- ``"required"``: the output is constrained (JSON Schema) to a JSON array of one or more calls
  ``{"name": <one of the functions>, "parameters": <that function's schema>}`` (vLLM's shape;
  at most one with ``parallel_tool_calls: false``), returned as ``tool_calls``;
- a named function ``{"type": "function", "function": {"name": ...}}``: the output is that
  function's arguments, constrained to its parameters' schema, returned as one call;
- ``"auto"`` (the default when there are tools): unconstrained; the server's tool-call parser
  (``--enable-auto-tool-choice --tool-call-parser hermes``) finds the calls in the text. Without
  those flags it is a 400 naming them, as vLLM's.

The prompt: a chat template that takes ``tools`` (it names the variable) gets them, and gets the
history's assistant ``tool_calls`` (arguments as objects, as Hugging Face templates read them)
and tool messages as they are. A template that does not (SmolLM2's) gets what the Qwen2 and
Hermes templates write: a system message that lists the functions in ``<tools></tools>`` and
asks for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (appended to the first
system message, or one of its own), the history's calls written that way in the assistant's
content, and tool results as a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from vconsole.entrypoints.openai.protocol import BadRequest
from vconsole.wire.sampling import StructuredSpec

TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")   # OpenAI's function names (and dots, as vLLM)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def tool(self) -> dict[str, Any]:
        """As the request gave it (what a chat template or the system prompt shows)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass
class ToolPlan:
    """What a chat request's tools ask: ``choice`` is none, auto, required or named
    (``named`` the function); ``functions`` what the model is shown."""

    choice: str
    functions: list[Function] = field(default_factory=list)
    named: Function | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the output is parsed for tool calls."""
        return self.choice != "none"

    def spec(self) -> StructuredSpec | None:
        """The constraint on the output (None for none and auto)."""
        if self.named is not None:
            return StructuredSpec("json", _json(self.named.parameters or EMPTY_PARAMETERS))
        if self.choice == "required":
            return StructuredSpec("json", _json(required_schema(self.functions,
                                                                self.parallel)))
        return None

    def shown(self) -> list[Function]:
        """The functions the prompt shows the model."""
        return [] if self.choice == "none" else self.functions


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               *, auto_enabled: bool) -> ToolPlan:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked: a 400
    naming the field for a tool that is not a function, a bad or repeated name, a choice that
    names no tool, a choice without tools, or ``auto`` on a server without the parser."""
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise BadRequest(f"tools.{i}.function.name: {name!r} is given twice",
                             param=f"tools.{i}.function.name")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none", functions, parallel=parallel)
    if not functions:
        raise BadRequest("tool_choice: a tool choice other than \"none\" needs tools",
                         param="tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise BadRequest(f"tool_choice: {tool_choice!r} is not one of "
                             f"{', '.join(TOOL_CHOICES)} or a named function",
                             param="tool_choice")
        if tool_choice == "auto" and not auto_enabled:
            raise BadRequest(f"tool_choice: \"auto\" tool choice needs the server started with "
                             f"{AUTO_FLAGS} (vconsole serve --enable-auto-tool-choice "
                             "--tool-call-parser hermes); send \"required\" or a named function "
                             "instead, or tool_choice \"none\"", param="tool_choice")
        if tool_choice == "auto":
            for i, fn in enumerate(functions):
                if fn.strict:
                    raise BadRequest(
                        f"tools.{i}.function.strict: strict arguments need tool_choice "
                        "\"required\" or a named function (where the arguments are "
                        "constrained to the schema); \"auto\" does not constrain them",
                        param=f"tools.{i}.function.strict")
        return ToolPlan(tool_choice, functions, parallel=parallel)
    name = _named(tool_choice)
    if name not in names:
        raise BadRequest(f"tool_choice.function.name: {name!r} is not one of the tools "
                         f"({', '.join(names)})", param="tool_choice.function.name")
    return ToolPlan("named", functions, named=functions[names.index(name)],
                    parallel=parallel)


def required_schema(functions: list[Function], parallel: bool = True) -> dict[str, Any]:
    """``tool_choice: "required"``'s JSON Schema: an array of 1+ (1 when not ``parallel``)
    ``{"name", "parameters"}`` objects, one shape per function. Each function's parameters are
    the top's ``$defs/<name>`` (the call's ``parameters`` a ``$ref`` to it), their own
    references rewritten to point there: ``#`` to ``#/$defs/<name>``, ``#/...`` (their
    ``$defs``, draft-07's ``definitions``, any pointer) to ``#/$defs/<name>/...``."""
    defs: dict[str, Any] = {}
    shapes = []
    for fn in functions:
        params = {k: v for k, v in (fn.parameters or EMPTY_PARAMETERS).items()
                  if k != "$schema"}     # the dialect of a root, not of a subschema
        defs[fn.name] = _rebase(params, f"#/$defs/{fn.name}")
        shapes.append({"type": "object",
                       "properties": {"name": {"type": "string", "enum": [fn.name]},
                                      "parameters": {"$ref": f"#/$defs/{fn.name}"}},
                       "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": shapes[0] if len(shapes) == 1 else {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


VALUE_KEYWORDS = ("const", "enum", "default", "examples")   # instances, not schemas
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions",
                 "dependentSchemas")   # a name -> schema map (a property named "$ref" is one)


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#``, ``#/...``) pointing under ``base``."""
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#"
                                                          or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in VALUE_KEYWORDS:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebase(v, base) for name, v in value.items()}
        else:
            out[key] = _rebase(value, base)
    return out


def takes_tools(template: str) -> bool:
    """Whether a chat template reads ``tools`` (then it renders them and the calls itself)."""
    try:
        import jinja2
        import jinja2.meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except Exception:   # a template plain jinja cannot parse (a custom tag): read the text
        return re.search(r"\btools\b", template) is not None


def template_messages(messages: list[dict[str, Any]], functions: list[Function],
                      native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (as `ChatMessage.template_dict` gives them) and the ``tools`` argument for
    the chat template: ``native`` (the template takes tools) passes both through, with each
    call's arguments as an object; else the Hermes rendering (the module's docstring)."""
    if native:
        convo = [_native_message(m) for m in messages]
        return convo, [f.tool() for f in functions] or None
    convo = []
    results = False          # the last message is a user turn of tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:
                convo[-1]["content"] += "\n" + block
            else:
                convo.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        calls = [hermes_call(c) for c in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + calls)
        convo.append(m)
    if functions:
        system = HERMES_SYSTEM.format(tools="\n".join(
            json.dumps(f.tool(), ensure_ascii=False) for f in functions))
        if convo and convo[0]["role"] == "system":
            convo[0] = {**convo[0], "content": f"{convo[0]['content']}\n\n{system}"}
        else:
            convo.insert(0, {"role": "system", "content": system})
    return convo, None


def hermes_call(call: dict[str, Any]) -> str:
    """One call of the history as the Hermes format writes it."""
    fn = call.get("function") or {}
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"),
                                         "arguments": _arguments(fn.get("arguments"))},
                                        ensure_ascii=False) + "\n</tool_call>"


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    return {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(
        c["function"].get("arguments"))}} for c in m["tool_calls"]]}


def _arguments(raw: Any) -> Any:
    """A call's arguments as an object when they are JSON text of one (templates want that)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _function(i: int, tool: Any) -> Function:
    where = f"tools.{i}"
    if not isinstance(tool, dict):
        raise BadRequest(f"{where}: a tool is an object", param=where)
    if tool.get("type") != "function":
        raise BadRequest(f"{where}.type: {tool.get('type')!r} tools are not supported (only "
                         "\"function\")", param=f"{where}.type")
    for key, value in tool.items():
        if key not in ("type", "function") and value is not None:
            raise BadRequest(f"{where}.{key}: not supported by this server",
                             param=f"{where}.{key}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function: the function's definition is needed",
                         param=f"{where}.function")
    for key, value in fn.items():
        if key not in FUNCTION_KEYS and value is not None:
            raise BadRequest(f"{where}.function.{key}: not supported by this server",
                             param=f"{where}.function.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise BadRequest(f"{where}.function.name: a function name is 1 to 64 letters, digits, "
                         "'_', '-' or '.'", param=f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"{where}.function.parameters: a JSON Schema object",
                         param=f"{where}.function.parameters")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.function.description: a string",
                         param=f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.function.strict: true or false",
                         param=f"{where}.function.strict")
    return Function(name, description, params, bool(strict))


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest("tool_choice: one of \"none\", \"auto\", \"required\" or a named function "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                         param="tool_choice")
    for key, value in choice.items():
        if key not in ("type", "function") and value is not None:
            raise BadRequest(f"tool_choice.{key}: not supported by this server",
                             param=f"tool_choice.{key}")
    for key, value in fn.items():
        if key != "name" and value is not None:
            raise BadRequest(f"tool_choice.function.{key}: not supported by this server",
                             param=f"tool_choice.function.{key}")
    return str(fn["name"])


def _json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
