"""Tool calling on chat: the request's tools checked, the constraining grammar of `required` and
a named function, and a parser per model family for the model's own tool-call format.

A family is what the model was trained to write, read off its chat template (the template that
renders `tools` is the one the model learned them from):

- `qwen` (Qwen2, Qwen2.5, Qwen3, Qwen3-MoE; Hermes style): `<tool_call>\\n{"name": ..,
  "arguments": {..}}\\n</tool_call>`, one block per call, anywhere after some content;
- `llama3`: `{"name": .., "parameters": {..}}` at the start of the answer, optionally after
  `<|python_tag|>`; several calls separated by `;`;
- `mistral`: `[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]` at the start of the answer.

A model whose chat template renders no tools (or renders them in a format none of these is)
still takes `required` and a named function, as vLLM takes them on any model: the tools are
described in a system message (`default_tool_prompt`) and the answer is constrained to the
`json` family's format, a JSON array of calls `[{"name": .., "arguments": {..}}, ..]`. `auto` needs
the model's own format and is refused there.

`tool_choice` `required` and a named function constrain the answer with xgrammar (a GrammarSpec
of kind `grammar`, param `tool_choice`): the family's own wrapping around JSON that validates
against `{"name": const, "arguments": <the function's parameters schema>}`, so the arguments
always parse against the function's schema. `auto` leaves the model free and parses what it
wrote; `none` never parses. Arguments are returned as the model's own JSON text.

`ToolStream` is the streaming side: it holds back text that may be the start of a tool call and
emits it as content once it cannot be, and turns a call into OpenAI's deltas (index, id, type,
function name, then argument fragments as they are generated).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraserve.engine.structured import check_spec, json_schema_ebnf, rename_rule
from loraserve.engine.types import GrammarSpec
from loraserve.server.errors import APIError

# the call object's opening up to its arguments value; group 1 is the name's JSON string body
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                        r'\s*:\s*')


@dataclass(frozen=True, slots=True)
class ToolFamily:
    """One family's tool-call format.

    `starts`: the texts that open the calls; `anywhere`: whether they may follow content (else
    only at the answer's start, after whitespace); `separators`: what may stand between and
    around calls (a regex, matched repeatedly); `args_key`: the arguments' key the model writes;
    `open`/`between`/`close`: the constrained answer's wrapping (EBNF string literals' text).
    """

    name: str
    starts: tuple[str, ...]
    anywhere: bool
    separators: re.Pattern[str]
    args_key: str
    open: str
    between: str
    close: str
    call_open: str = ""
    call_close: str = ""


QWEN = ToolFamily("qwen", ("<tool_call>",), True, re.compile(r"\s+|</?tool_call>"), "arguments",
                  "", "\n", "", call_open="<tool_call>\n", call_close="\n</tool_call>")
LLAMA3 = ToolFamily("llama3", ("<|python_tag|>", "{"), False, re.compile(r"\s+|;|<\|python_tag\|>"),
                    "parameters", "", "; ", "")
MISTRAL = ToolFamily("mistral", ("[TOOL_CALLS]", "[{"), False, re.compile(r"\[TOOL_CALLS\]|\s+|[,\[\]]"),
                     "arguments", "[", ", ", "]")
FAMILIES = {f.name: f for f in (QWEN, LLAMA3, MISTRAL)}
# forced calls on a model whose template renders no tools: a JSON array of calls, which the
# default tool prompt asks for and the grammar enforces
JSON_CALLS = ToolFamily("json", ("[",), False, re.compile(r"\s+|[,\[\]]"), "arguments", "[", ", ",
                        "]")
# vLLM's --tool-call-parser names -> the family that parses that format
PARSERS = {"hermes": QWEN, "llama3_json": LLAMA3, "mistral": MISTRAL}


def check_parser(name: str | None) -> ToolFamily | None:
    """The family of vLLM's `--tool-call-parser NAME` (None: read off the chat template);
    ValueError naming the ones loraserve parses otherwise."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one loraserve parses; it parses "
                         f"{', '.join(PARSERS)} (or, without the flag, the format the chat "
                         "template writes)")
    return PARSERS[name]


def family_of(chat_template: str | None) -> ToolFamily | None:
    """The family whose tool-call markers the chat template writes; None: it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return QWEN
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return LLAMA3
    return None


TOOL_CALL = "tool_call"  # the kind of a forced call's deferred grammar: [family, functions, one]


# -- the request -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools, checked: what the template gets (`tools`; None: nothing), whether
    and how to parse the answer (`family` None: never), the grammar of a forced call, and the
    system message that describes the tools when the template does not (`system`)."""

    tools: list[dict[str, Any]] | None
    family: ToolFamily | None
    spec: GrammarSpec | None
    max_calls: int | None  # None: any number
    system: str | None = None


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each function tool (an object's: a schema without a `type`
    is given `"type": "object"`, as the call's arguments are one); 400 naming the entry
    otherwise."""
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{param}: only tools of type \"function\" are supported",
                           param=param, code="unsupported_parameter")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{param}.function", "must be an object with a non-empty \"name\"")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"{param}.function.parameters", "must be a JSON schema object")
        if "type" not in params:
            params = {"type": "object", **params}
        elif params["type"] != "object":
            raise _bad(f"{param}.function.parameters", "must describe an object (the call's "
                       "arguments), \"type\": \"object\"")
        if fn["name"] in functions:
            raise _bad(f"{param}.function.name", f"{fn['name']!r} is declared twice")
        functions[fn["name"]] = params
    return functions


def _choice(tool_choice: Any, functions: dict[str, dict[str, Any]]) -> str | None:
    """"none", "auto", "required", or None for a named function (checked against the tools)."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not functions:
            raise _bad("tool_choice", "\"required\" needs at least one tool")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(fn, dict) and tool_choice.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise _bad("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in functions:
        raise _bad("tool_choice", f"names the function {fn['name']!r}, which is not in tools")
    return None


def plan_tools(tools: Any, tool_choice: Any, parallel: bool | None,
               chat_template: str | None, parser: ToolFamily | None = None,
               defer: bool = False) -> ToolPlan | None:
    """The request's ToolPlan, or None when it brings no tools; APIError (400) for what is not
    honoured: a non-function tool, an unknown named function, `auto` on a model whose chat
    template renders no tools in a format loraserve parses. `parser` (`serve
    --tool-call-parser`) is the format of a template that renders tools, instead of the one its
    markers say. `defer`: a forced call's grammar is left to be built and checked off the event
    loop (a `tool_call` spec: `grammar_checks.GrammarChecks.settle`)."""
    if tools is None or tools == []:  # "none", "auto" and parallel_tool_calls: nothing to do
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return None
    functions = _check_tools(tools)
    choice = _choice(tool_choice, functions)
    renders = bool(chat_template) and "tools" in chat_template
    family = (parser if renders else None) or family_of(chat_template)
    one = parallel is False or choice is None
    max_calls = 1 if one else None
    if choice == "none":  # the template gets the tools (it may render them); nothing is parsed
        return ToolPlan(tools, None, None, max_calls)
    if family is None and choice == "auto":
        raise APIError(400, "tools: tool_choice \"auto\" is not supported by this model: its chat "
                       "template renders no tools in a tool-call format loraserve parses (Qwen, "
                       "Llama 3, Mistral; serve --tool-call-parser names one); \"required\" and "
                       "a named function work on any model", param="tools",
                       code="unsupported_parameter")
    if choice == "auto":
        return ToolPlan(tools, family, None, max_calls)
    name = None if choice == "required" else tool_choice["function"]["name"]
    named = functions if name is None else {name: functions[name]}
    if family is None:  # the tools described in a system message, the answer a JSON array
        return ToolPlan(None, JSON_CALLS, _forced(JSON_CALLS, named, one, defer), max_calls,
                        default_tool_prompt(tools, named, name, one))
    return ToolPlan(tools, family, _forced(family, named, one, defer), max_calls)


def _forced(family: ToolFamily, named: dict[str, dict[str, Any]], one: bool,
            defer: bool) -> GrammarSpec:
    """A forced call's grammar: built and checked here, or (`defer`) left to the grammar
    workers."""
    if defer:
        return GrammarSpec(TOOL_CALL, json.dumps([family.name, named, one]), "tool_choice")
    spec = GrammarSpec("grammar", call_grammar(family, named, one), "tool_choice")
    check_spec(spec)
    return spec


def default_tool_prompt(tools: list[dict[str, Any]], functions: dict[str, dict[str, Any]],
                        name: str | None, one: bool) -> str:
    """The system message that describes `functions` (name -> parameters schema; descriptions
    from `tools`) to a model whose chat template renders no tools, and the answer the grammar
    will hold it to: a JSON array of calls."""
    described = {t["function"]["name"]: t["function"] for t in tools}
    lines = ["You can call functions. Each is given as JSON: its name, what it does and the "
             "JSON Schema of its arguments.", ""]
    for fn, params in functions.items():
        entry: dict[str, Any] = {"name": fn}
        if described[fn].get("description"):
            entry["description"] = described[fn]["description"]
        entry["parameters"] = params
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append("")
    what = (f"Call the function {name}" if name is not None else
            "Call one of these functions" if one else "Call one or more of these functions")
    lines.append(f"{what}. Answer with the call{'' if one else 's'} alone, as a JSON array: "
                 '[{"name": <the function\'s name>, "arguments": <an object of its arguments>}]')
    return "\n".join(lines)


def call_grammar(family: ToolFamily, functions: dict[str, dict[str, Any]], one: bool) -> str:
    """EBNF of the family's answer holding one call (or, unless `one`, one or more) of
    `functions`, each `{"name": const, <args_key>: <its parameters schema>}`."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, family.args_key: params},
              "required": ["name", family.args_key], "additionalProperties": False}
             for name, params in functions.items()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:  # as a json_schema answer's: compact, JSON strings (structured.json_schema_ebnf)
        call = json_schema_ebnf(json.dumps(schema))
    except Exception as exc:  # xgrammar's schema converter: RuntimeError / ValueError
        raise _bad("tools", f"a function's parameters schema does not compile: "
                   f"{str(exc).strip()[:300]}") from None
    # the call's rules, its root renamed (rule names such as root_1 keep their names)
    rules = rename_rule(call, "root", "tool_call")
    one_call = _seq(_lit(family.call_open), "tool_call", _lit(family.call_close))
    more = "" if one else f"({_seq(_lit(family.between), one_call)})*"
    return f"root ::= {_seq(_lit(family.open), one_call, more, _lit(family.close))}\n{rules}"


def _lit(text: str) -> str:
    """An EBNF string literal of `text`; "" (left out of a sequence) when it is empty."""
    return json.dumps(text) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


# -- the answer ------------------------------------------------------------------------------------

def _value_end(text: str, start: int) -> int | None:
    """End index of the JSON object or array starting at text[start], None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(slots=True)
class Call:
    """One call as far as it is written: its name once known, its arguments' text so far."""

    name: str | None
    arguments: str
    complete: bool  # the call object is closed and its arguments parse


def _skip(family: ToolFamily, text: str, pos: int) -> int:
    while True:
        m = family.separators.match(text, pos)
        if m is None or m.end() == pos:
            return pos
        pos = m.end()


def _read_call(text: str, pos: int) -> tuple[Call | None, int | None]:
    """The call written from text[pos] (None: not a call) and where the next may start (None:
    this one is still open)."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:  # not a call, or its head not written yet: either way, nothing more now
        return None, None
    name = json.loads(f'"{head.group(1)}"')
    args_start = head.end()
    if text[args_start:args_start + 1] not in ("{", ""):
        return None, pos
    args_end = _value_end(text, args_start) if args_start < len(text) else None
    if args_end is None:
        return Call(name, text[args_start:], False), None
    close = re.compile(r"\s*\}").match(text, args_end)
    arguments = text[args_start:args_end]
    if close is None:
        return Call(name, arguments, False), None
    try:
        ok = isinstance(json.loads(arguments), dict)
    except ValueError:
        ok = False
    return (Call(name, arguments, True) if ok else None), close.end()


def read_calls(family: ToolFamily, region: str) -> list[Call]:
    """The calls written in `region` (the text from the first start marker on), in order; the
    last may be incomplete. Reading stops at text that is not a call."""
    calls: list[Call] = []
    pos = 0
    while True:
        pos = _skip(family, region, pos)
        if pos >= len(region):
            return calls
        call, pos = _read_call(region, pos)
        if call is None:
            return calls
        calls.append(call)
        if pos is None or not call.complete:
            return calls


def _start(family: ToolFamily, text: str) -> int | None:
    """Index where the tool calls start in `text`, if a start marker is there."""
    if family.anywhere:
        found = [i for i in (text.find(s) for s in family.starts) if i >= 0]
        return min(found) if found else None
    lead = len(text) - len(text.lstrip())
    return lead if text.startswith(family.starts, lead) else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: Call, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def parse(family: ToolFamily, text: str, max_calls: int | None,
          cut: bool = False) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer: the content is the text before the calls (None when
    empty); an answer whose calls do not parse is all content. An answer `cut` by max_tokens
    keeps its last call as far as it was written once its name is (what its stream sent: the
    name and the arguments' text so far; the finish reason says `length`), and the markup of a
    call cut before its name, even of a start marker, is not content either."""
    start = _start(family, text)
    calls = [] if start is None else [c for c in read_calls(family, text[start:])
                                      if c.complete or (cut and c.name is not None)]
    if cut and start is None:
        return text[:unmarked_end(family, text)] or None, []
    if not calls and not cut:
        return text, []
    content = text[:start].strip()
    return content or None, calls[:max_calls]


def unmarked_end(family: ToolFamily, text: str) -> int:
    """End of the text that cannot begin a call: not a start marker's prefix at the end, no
    trailing whitespace (it may precede one); in a family that opens only at the answer's start,
    nothing while the answer may still open with a marker."""
    if not family.anywhere:
        head = text.lstrip()
        if any(s.startswith(head) or head.startswith(s) for s in family.starts):
            return 0
        return len(text)
    end = len(text.rstrip())
    for s in family.starts:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text.endswith(s[:k], 0, end):
                end = min(end, len(text[:end - k].rstrip()))
                break
    return end


# -- streaming --------------------------------------------------------------------------------------

@dataclass(slots=True)
class ToolStream:
    """One streamed choice's tool-call state: text in, OpenAI delta fields out."""

    family: ToolFamily
    max_calls: int | None
    text: str = ""
    sent: int = 0            # characters of content emitted
    start: int | None = None  # where the calls start, once seen
    calls: list[tuple[str, int]] = field(default_factory=list)  # (id, argument chars sent) per call
    cut: bool = False  # the answer ended at max_tokens

    def feed(self, piece: str, final: bool, cut: bool = False) -> dict[str, Any]:
        """The delta fields (`content`, `tool_calls`) that `piece` releases; `final` flushes,
        and an answer `cut` by max_tokens keeps a started call out of the content (`parse`)."""
        self.text += piece
        self.cut = cut
        delta: dict[str, Any] = {}
        if self.start is None:
            self.start = _start(self.family, self.text)
        calls = self._call_deltas() if self.start is not None else []
        content = self._content(final)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called(self) -> bool:
        """Whether a tool call was streamed (the finish reason is then `tool_calls`)."""
        return bool(self.calls)

    def _content(self, final: bool) -> str:
        """Content that can no longer be part of a call: the text before the calls (without the
        whitespace that precedes them), all of it once the answer ends without a call (but
        for a start marker's beginning when max_tokens cut it), and while no call has started,
        what cannot begin one."""
        if self.start is not None and (self.calls or not final or self.cut):
            end = len(self.text[:self.start].rstrip())
        elif final and not self.cut:
            end = len(self.text)
        else:
            end = self._safe_end()
        piece = self.text[self.sent:end]
        self.sent = max(end, self.sent)
        return piece

    def _safe_end(self) -> int:
        return max(self.sent, unmarked_end(self.family, self.text))

    def _call_deltas(self) -> list[dict[str, Any]]:
        """New calls (header with id, type and name) and argument fragments since the last feed."""
        out: list[dict[str, Any]] = []
        calls = read_calls(self.family, self.text[self.start:])[:self.max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.calls):
                call_id = new_call_id()
                self.calls.append((call_id, 0))
                out.append({"index": index, "id": call_id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            call_id, done = self.calls[index]
            if len(call.arguments) > done:
                fragment = call.arguments[done:]
                self.calls[index] = (call_id, len(call.arguments))
                if out and out[-1]["index"] == index:
                    out[-1]["function"]["arguments"] += fragment
                else:
                    out.append({"index": index, "function": {"arguments": fragment}})
        return out
