"""Structured output's grammar text, shared by the API process and the engine core: what a request's
`GrammarSpec` (kind, text) means as a grammar, and whether it parses, with no tokenizer.

`check_spec` validates a spec (the API process, before the request is queued: a 400 naming
`param`); `json_schema_ebnf` and `json_safe_strings` write the compact JSON grammar the server
constrains a schema with; `rename_rule` renames an EBNF rule (tool calling composes grammars with
it). The engine core compiles these grammars against its vocabulary
(`engine.core.structured.GrammarEngine`); the server imports this module, never the core's
(an import contract, pyproject.toml). xgrammar is imported on first use.
"""
from __future__ import annotations

import json
import re

from loraserve.catalog.lru import BoundedLRU

from .types import STRUCTURED_KINDS as KINDS
from .types import EngineError, GrammarSpec

__all__ = ["GrammarSpec", "JSON_OBJECT_SCHEMA", "check_spec", "json_safe_strings",
           "json_schema_ebnf", "rename_rule"]
GRAMMAR_CACHE_SIZE = 256
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex, choice list or grammar longer than this: 400


def _xgr():
    import xgrammar  # imported on first use: a server that never sees a grammar never loads it
    return xgrammar


def _choice_ebnf(text: str) -> str:
    choices = json.loads(text)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# json_object: one JSON object or array (vLLM's and xgrammar's built-in JSON grammar allow both),
# written compact as a json_schema answer is (the built-in grammar lets whitespace run on forever)
JSON_OBJECT_SCHEMA = '{"type": ["object", "array"]}'


def json_schema_ebnf(schema: str) -> str:
    """The EBNF of JSON that validates against `schema` (JSON text), as the server constrains it:
    xgrammar's conversion, compact (`any_whitespace=False`: no whitespace between tokens beyond
    the fixed `", "` and `": "`, so the answer cannot loop on whitespace), properties in the
    schema's order, and strings that are JSON (`json_safe_strings`)."""
    grammar = _xgr().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return json_safe_strings(str(grammar))


def _grammar_of(spec: GrammarSpec):
    """The xgrammar Grammar of spec (no tokenizer: validation only)."""
    xgr = _xgr()
    if spec.kind in ("json_object", "json_schema"):
        schema = spec.text if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
        return xgr.Grammar.from_ebnf(json_schema_ebnf(schema))
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(spec.text))
    return xgr.Grammar.from_ebnf(spec.text)


# -- strings that are JSON by construction ---------------------------------------------------------
#
# JSON forbids a raw U+0000-U+001F inside a string (it must be an escape: `\t`, `\u0001`), and a
# `"` or `\` there must be escaped too, and the text must be UTF-8. xgrammar's JSON-schema
# conversion (0.2.x) breaks these rules in three places:
#
# - a length-bounded string (`minLength`/`maxLength`, a `propertyNames` bound) is
#   `"\"" [^"\\\r\n]{m,n} "\""`: a raw TAB or U+0001 inside it;
# - a `pattern` holding a `"`, a `\`, a TAB or another control character is expanded to literals
#   and classes of the characters the regex means, written raw (`^a"b$` writes `"a"b"`, `^a\tb$`
#   a raw TAB); other patterns are `Regex("...", json_string=true)` nodes, which never write a
#   `"` and let `.` or `[^a]` match the bytes of a UTF-16 surrogate;
# - every class may match a surrogate's 3-byte encoding (invalid UTF-8: U+FFFD in the text, one
#   character of the grammar as three of the answer, past a maxLength).
#
# `json_safe_strings` rewrites the grammar: each Regex node becomes the EBNF of the characters its
# pattern means (`_expanded_regex`); in the rules that are a string's content (referenced between
# the two `"\""` delimiters, and what they reference, but for xgrammar's `basic_*` rules) every
# literal and class writes `"`, `\` and control characters as JSON escapes; in the other rules
# (the structure, numbers, keys), the control characters (a compact grammar has no whitespace
# left there); no class matches a surrogate. A length then counts an escape as the one
# character it stands for. Lookaheads `(= ...)` are left as they are.

_SHORT_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}
_CONTROLS = frozenset(range(0x20))
_IN_STRINGS = _CONTROLS | {0x22, 0x5C}
_EBNF_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "a": "\a", "b": "\b",
                 "e": "\x1b", "0": "\0"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_SURROGATES = (0xD800, 0xDFFF)
_CONTENT_ROOT = re.compile(r'"\\"" (\w+)(?:\{\d+, ?-?\d+\})? "\\""')
_NAME = re.compile(r"[A-Za-z_]\w*")


def _read_char(text: str, i: int) -> tuple[int, int]:
    """(code point, next index) of the possibly escaped character at text[i] (EBNF syntax)."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    c = text[i + 1]
    if c in _HEX_DIGITS:
        n = _HEX_DIGITS[c]
        return int(text[i + 2:i + 2 + n], 16), i + 2 + n
    return ord(_EBNF_ESCAPES.get(c, c)), i + 2


def _skip_quoted(text: str, i: int) -> int:
    """Index past the string literal opening at text[i]."""
    i += 1
    while text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_class(text: str, i: int) -> int:
    """Index past the character class opening at text[i]."""
    i += 1
    while text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_group(text: str, i: int) -> int:
    """Index past the parenthesized group opening at text[i] (literals and classes skipped)."""
    depth = 0
    while True:
        c = text[i]
        if c == '"':
            i = _skip_quoted(text, i)
            continue
        if c == "[":
            i = _skip_class(text, i)
            continue
        depth += (c == "(") - (c == ")")
        i += 1
        if depth == 0:
            return i


def _json_escape(code: int) -> str:
    """The JSON escape of a character a string may not hold raw, as EBNF literal text."""
    short = _SHORT_ESCAPES.get(code)
    return json.dumps("\\" + short if short else f"\\u{code:04x}")[1:-1]


def _escape_alternatives(chars: set[int]) -> list[str]:
    """EBNF alternatives writing each character of `chars` as a JSON escape: its short form
    where it has one, else `\\u00XX` (digits in either case)."""
    alts = [f'"{_json_escape(c)}"' for c in sorted(chars) if c in _SHORT_ESCAPES]
    for high in (0, 1):
        lows = sorted(c & 15 for c in chars if c < 0x20 and c >> 4 == high
                      and c not in _SHORT_ESCAPES)
        if lows:
            digits = "".join(dict.fromkeys("".join(f"{d:x}{d:X}" for d in lows)))
            alts.append(f'"\\\\u00{high}" [{digits}]')
    return alts


def _fix_literal(text: str, special: frozenset[int]) -> str:
    """A string literal with its characters in `special` written as JSON escapes."""
    out, i = ['"'], 1
    while i < len(text) - 1:
        code, j = _read_char(text, i)
        out.append(_json_escape(code) if code in special else text[i:j])
        i = j
    out.append('"')
    return "".join(out)


def _fix_class(text: str, special: frozenset[int]) -> str:
    """A character class without the characters in `special` and without UTF-16 surrogates
    (which are not characters: xgrammar lets a class match their 3-byte encodings, invalid
    UTF-8 that reaches the text as U+FFFD), and the JSON escapes of the special characters it
    matched beside it (as alternatives)."""
    negated = text.startswith("[^")
    i, end = (2 if negated else 1), len(text) - 1
    items: list[tuple[int, int]] = []  # (low, high) of each character or range
    while i < end:
        lo, j = _read_char(text, i)
        hi = lo
        if text[j] == "-" and j + 1 < end:
            hi, j = _read_char(text, j + 1)
        items.append((lo, hi))
        i = j
    listed = {c for c in special if any(lo <= c <= hi for lo, hi in items)}
    matched = set(special) - listed if negated else listed
    first, last = _SURROGATES
    if negated:  # matches them unless it excludes them all already
        has_surrogates = not any(lo <= first and last <= hi for lo, hi in items)
    else:
        has_surrogates = any(first <= hi and lo <= last for lo, hi in items)
    if not matched and not has_surrogates:
        return text
    if negated:  # exclude every special character and the surrogates; escapes beside it
        excluded = _runs(special - listed) + ([_SURROGATES] if has_surrogates else [])
        kept = text[:-1] + "".join(_class_range(a, b) for a, b in excluded) + "]"
    else:  # the items, cut around the special characters and the surrogates
        cut = sorted(_runs(set(special)) + [_SURROGATES])
        parts = [_class_range(a, b) for lo, hi in items for a, b in _subtract(lo, hi, cut)]
        kept = f"[{''.join(parts)}]" if parts else ""
    alts = ([kept] if kept else []) + _escape_alternatives(matched)
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _subtract(lo: int, hi: int, cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The range [lo, hi] without the sorted, disjoint ranges `cut`, as ranges."""
    out: list[tuple[int, int]] = []
    for a, b in cut:
        if b < lo or a > hi:
            continue
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
        if lo > hi:
            return out
    out.append((lo, hi))
    return out


def _runs(codes: set[int]) -> list[tuple[int, int]]:
    """`codes` as maximal ranges of consecutive code points, in order."""
    out: list[tuple[int, int]] = []
    for c in sorted(codes):
        if out and out[-1][1] == c - 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


def _class_char(code: int) -> str:
    """One character as an EBNF class writes it."""
    if code < 0x20 or code in (0x22, 0x2D, 0x5B, 0x5C, 0x5D, 0x5E) or code > 0x7E:
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF \
            else f"\\U{code:08x}"
    return chr(code)


def _class_range(lo: int, hi: int) -> str:
    return _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"


# what a rule outside a string's content must hold for `_rewrite` to change it: a negated class
# (surrogates), a class range that may span them, or an escape or raw character that may be a
# control character; most rules (xgrammar's basic_* ones, the structure) hold none
_MAY_CHANGE = re.compile(r"\[\^|[^\\]-\\[uU]|\\[0-9nrtfvabexuU]|[\x00-\x1f]")


def _rewrite(body: str, special: frozenset[int]) -> str:
    """A rule's body with the characters in `special` written as JSON escapes wherever the
    body generates them (lookaheads and Regex nodes left as they are)."""
    if special is _CONTROLS and _MAY_CHANGE.search(body) is None:
        return body
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            j = _skip_quoted(body, i)
            out.append(_fix_literal(body[i:j], special))
        elif c == "[":
            j = _skip_class(body, i)
            out.append(_fix_class(body[i:j], special))
        elif body.startswith("(=", i):
            j = _skip_group(body, i)
            out.append(body[i:j])
        elif body.startswith("Regex(", i):
            j = _skip_group(body, i + len("Regex"))
            out.append(body[i:j])
        else:
            j = i + 1
            out.append(c)
        i = j
    return "".join(out)


def _pieces(body: str):
    """`body` cut into (text, is_name) pieces: rule names, and everything else (literals,
    classes and Regex nodes whole, so a name inside them is never taken for a reference)."""
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            j = _skip_quoted(body, i)
        elif c == "[":
            j = _skip_class(body, i)
        elif body.startswith("Regex(", i):
            j = _skip_group(body, i + len("Regex"))
        elif (m := _NAME.match(body, i)) is not None:
            yield m.group(), True
            i = m.end()
            continue
        else:
            j = i + 1
        yield body[i:j], False
        i = j


def _references(body: str) -> set[str]:
    """The rule names `body` references (literals, classes and Regex nodes skipped)."""
    return {text for text, is_name in _pieces(body) if is_name}


def rename_rule(ebnf: str, old: str, new: str) -> str:
    """`ebnf` (one rule per line, as xgrammar prints it) with the rule `old` named `new`, where
    it is defined and referenced; literals, classes and Regex nodes are left as they are."""
    out = []
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, body = line.split(" ::= ", 1)
        out.append(f"{new if name == old else name} ::= {_renamed(body, old, new)}\n")
    return "".join(out)


def _renamed(body: str, old: str, new: str) -> str:
    return "".join(new if is_name and text == old else text for text, is_name in _pieces(body))


def _decode_literal(text: str) -> str:
    """The characters of an EBNF string literal (its quotes included in `text`)."""
    out, i = [], 1
    while i < len(text) - 1:
        code, i = _read_char(text, i)
        out.append(chr(code))
    return "".join(out)


def _ecma_dots(pattern: str) -> str:
    """`pattern` with each `.` outside a class written as the class it means in ECMA-262 (and
    in Python's `re`, which matches more): any character but a line terminator."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ".":
            c = "[^\\n\\r\\u2028\\u2029]"
        out.append(c)
        i += 1
    return "".join(out)


def _expanded_regex(body: str) -> str:
    """A rule body `Regex("...", json_string=true)` (a `pattern` xgrammar keeps as a regex, which
    lets a `.` or `[^a]` match a surrogate's bytes) as EBNF of the characters the pattern means
    (xgrammar's own regex converter: a full match, which `pattern`'s search semantics admit), to
    be written JSON by `json_safe_strings`; the body as it is when the converter cannot."""
    from xgrammar.testing import _regex_to_ebnf  # the converter xgrammar's own expansion uses

    try:
        pattern = _decode_literal(body[len("Regex("):_skip_quoted(body, len("Regex("))])
        lines = [line for line in _regex_to_ebnf(_ecma_dots(pattern)).splitlines() if line]
    except Exception:  # a construct it does not take (lookaround, flags): xgrammar's node
        return body
    if len(lines) != 1 or not lines[0].startswith("root ::= "):
        return body
    return "(" + lines[0].removeprefix("root ::= ") + ")"


def json_safe_strings(ebnf: str) -> str:
    """`ebnf` (a compact JSON grammar as xgrammar prints it: one rule per line) with every
    string JSON (see above)."""
    rules = dict(line.split(" ::= ", 1) for line in ebnf.splitlines() if line.strip())
    for name, body in rules.items():
        if body.startswith("Regex(") and body.endswith(", json_string=true)"):
            rules[name] = _expanded_regex(body)
    content: set[str] = set()
    todo = [m.group(1) for body in rules.values() for m in _CONTENT_ROOT.finditer(body)]
    while todo:
        name = todo.pop()
        if name in content or name not in rules or name.startswith("basic_"):
            continue
        content.add(name)
        todo.extend(_references(rules[name]))
    return "".join(f"{name} ::= {_rewrite(body, _IN_STRINGS if name in content else _CONTROLS)}\n"
                   for name, body in rules.items())


def _compile_error(spec: GrammarSpec, exc: BaseException) -> EngineError:
    return EngineError(f"{spec.param}: the {spec.kind.replace('_', ' ')} does not compile: "
                       f"{str(exc).strip()[:500]}", param=spec.param)


# the (kind, text) keys check_spec passed: a client that sends the same schema on every request
# pays its conversion once per process (a 300-property schema takes ~0.1 s)
_CHECKED: BoundedLRU[tuple[str, str], bool] = BoundedLRU(GRAMMAR_CACHE_SIZE)


def check_spec(spec: GrammarSpec) -> None:
    """Raise EngineError (400, param = spec.param) unless spec's grammar parses."""
    if _CHECKED.get(spec.key):
        return
    if spec.kind not in KINDS:
        raise EngineError(f"unknown structured output kind {spec.kind!r}", param=spec.param)
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise EngineError(f"{spec.param}: at most {MAX_GRAMMAR_CHARS} characters",
                          param=spec.param)
    try:
        _grammar_of(spec)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's text
        raise _compile_error(spec, exc) from None
    _CHECKED.put(spec.key, True)
