"""Tool-call parsing per family (server/tool_calls.py), without a model: `auto`'s parser on each
family's format, the forced-call grammars (what they accept and refuse, through xgrammar), and
the stream: fed in any split of the text, a ToolStream's deltas add up to exactly what the
whole-answer parser finds (the content, then the calls), and it never releases as content text
that turns out to open a call (a generated property test, seeded and bounded)."""
from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.model.tiny import CHATML_TEMPLATE
from loraserve.server.errors import APIError
from loraserve.server.tool_calls import (FAMILIES, LLAMA3, MISTRAL, QWEN, Call, ToolFamily,
                                         ToolStream, call_grammar, family_of, parse, plan_tools)

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]


def _write(family: ToolFamily, calls: list[tuple[str, str]], content: str = "") -> str:
    """An answer as the family's models write it: content, then the calls."""
    key = family.args_key
    objs = [f'{{"name": {json.dumps(n)}, "{key}": {a}}}' for n, a in calls]
    if family is QWEN:
        body = "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
        return f"{content}\n\n{body}" if content else body
    if family is LLAMA3:
        return "<|python_tag|>" + "; ".join(objs)
    return "[TOOL_CALLS] [" + ", ".join(objs) + "]"


CASES = [[("add", '{"a": 1, "b": 2}')], [("add", '{"a": 1, "b": 2}'), ("now", "{}")],
         [("now", '{"tz": "UTC", "nested": {"x": [1, "}"]}}')]]


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
@pytest.mark.parametrize("calls", CASES, ids=["one", "two", "nested"])
def test_each_family_parses_its_own_format(family: ToolFamily, calls: list) -> None:
    content, found = parse(family, _write(family, calls), None)
    assert content is None and [(c.name, c.arguments) for c in found] == calls
    assert all(c.complete for c in found)
    _, first = parse(family, _write(family, calls), 1)  # parallel_tool_calls false
    assert [(c.name, c.arguments) for c in first] == calls[:1]


def test_qwen_content_before_the_calls_and_what_is_not_a_call() -> None:
    text = _write(QWEN, CASES[0], content="Let me add.")
    assert parse(QWEN, text, None) == ("Let me add.", [Call("add", '{"a": 1, "b": 2}', True)])
    for plain in ("no calls here", "<tool_call>\nnot json\n</tool_call>",
                  '<tool_call>\n{"name": "add", "arguments": {"a": 1\n',  # cut short
                  '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'):
        assert parse(QWEN, plain, None) == (plain, [])
    assert parse(LLAMA3, '{"answer": 42}', None) == ('{"answer": 42}', [])  # JSON, no call
    assert parse(LLAMA3, 'I think {"name": "x", "parameters": {}}', None)[1] == []  # not first


def test_family_of_reads_the_chat_template() -> None:
    assert family_of(CHATML_TEMPLATE) is QWEN
    assert family_of("{{ tools }} <|python_tag|>") is LLAMA3
    assert family_of("{% if tools %}[TOOL_CALLS]{% endif %}") is MISTRAL
    assert family_of("{{ messages }}") is None and family_of(None) is None


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_forced_grammars_accept_the_format_and_valid_arguments_only(family: ToolFamily) -> None:
    functions = {"add": ADD, "now": {"type": "object", "properties": {}}}

    def accepts(ebnf: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
            xgr.Grammar.from_ebnf(ebnf)), terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    compact = {"add": '{"a": 1, "b": 2}', "now": "{}"}
    one, many = call_grammar(family, functions, True), call_grammar(family, functions, False)
    single = _write(family, [("add", compact["add"])])
    double = _write(family, [("add", compact["add"]), ("now", compact["now"])])
    if family is LLAMA3:  # the constrained answer is the JSON alone (no python tag)
        single, double = single.removeprefix("<|python_tag|>"), double.removeprefix("<|python_tag|>")
    if family is MISTRAL:  # the constrained answer is the JSON array alone
        single, double = single.removeprefix("[TOOL_CALLS] "), double.removeprefix("[TOOL_CALLS] ")
    assert accepts(one, single) and accepts(many, single) and accepts(many, double)
    assert not accepts(one, double)
    assert not accepts(one, single.replace('"b": 2', '"b": "2"'))  # against the schema
    assert not accepts(one, single.replace('"add"', '"sub"'))  # an unknown function


def test_plan_tools_decides_the_request() -> None:
    plan = plan_tools(TOOLS, None, None, CHATML_TEMPLATE)  # tools given: auto
    assert plan.family is QWEN and plan.spec is None and plan.max_calls is None
    assert plan_tools(TOOLS, "none", None, CHATML_TEMPLATE).family is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None,
                       CHATML_TEMPLATE)
    assert named.spec.kind == "grammar" and named.spec.param == "tool_choice"
    assert named.max_calls == 1  # the name is an EBNF literal of the JSON string "add"
    assert '\\"add\\"' in named.spec.text and '\\"now\\"' not in named.spec.text
    assert plan_tools(TOOLS, "required", False, CHATML_TEMPLATE).max_calls == 1
    assert plan_tools([], "auto", True, CHATML_TEMPLATE) is None
    with pytest.raises(APIError) as err:
        plan_tools(TOOLS, "auto", None, "{{ messages }}")  # the template renders no tools
    assert err.value.param == "tools"


# -- the stream --------------------------------------------------------------------------------

def _stream(family: ToolFamily, pieces: list[str],
            cut: bool = False) -> tuple[str, list[tuple[str, str]], list]:
    stream = ToolStream(family, None)
    deltas = [stream.feed(p, i == len(pieces) - 1, cut and i == len(pieces) - 1)
              for i, p in enumerate(pieces)]
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function"
                assert c["id"].startswith("call_")
                calls[c["index"]] = [c["function"]["name"], ""]
            calls[c["index"]][1] += c["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


_word = st.text(st.sampled_from("ab <{}\"[]:;,\n_/>|"), max_size=12)
_answers = st.one_of(
    st.tuples(st.sampled_from(list(FAMILIES)), st.sampled_from(range(len(CASES))), _word),
    st.tuples(st.sampled_from(list(FAMILIES)), st.none(), _word))


def _answer_text(answer: Any) -> tuple[ToolFamily, str]:
    name, case, words = answer
    family = FAMILIES[name]
    if case is None:  # text that may look like the start of a call, and is not one
        return family, words + "<tool_" + words if family is QWEN else words + "{" + words
    return family, _write(family, CASES[case], content=words.strip() if family is QWEN else "")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(answer=_answers, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_of_a_stream_adds_up_to_the_parsed_answer(answer: Any, cuts: list[int]) -> None:
    family, text = _answer_text(answer)
    content, calls, deltas = _stream(family, _splits(text, cuts))
    want_content, want_calls = parse(family, text, None)
    assert calls == [(c.name, c.arguments) for c in want_calls]
    if want_calls:
        assert content.strip() == (want_content or "")
        first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
        assert all("content" not in d for d in deltas[first_call + 1:])
    else:
        assert content == text  # all of it, once it is clear that no call follows


@settings(max_examples=300, deadline=None, derandomize=True)
@given(answer=_answers, end=st.integers(0, 400), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_an_answer_cut_anywhere_streams_what_parse_gives(answer: Any, end: int,
                                                        cuts: list[int]) -> None:
    """max_tokens may end an answer at any character: streamed in any pieces or whole, the calls
    named so far (the last as far as written) and the same content, and no call markup in it."""
    family, text = _answer_text(answer)
    text = text[:end % (len(text) + 1)]
    content, calls, _ = _stream(family, _splits(text, cuts), cut=True)
    want_content, want_calls = parse(family, text, None, cut=True)
    assert calls == [(c.name, c.arguments) for c in want_calls]
    assert content.strip() == (want_content or "").strip()
    if any(s.startswith(text.strip()) for s in family.starts):  # cut inside a start marker
        assert content.strip() == ""
