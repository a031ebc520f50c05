"""A grammar worker process (`grammar_checks.GrammarChecks`): one job at a time from its pipe, a
`GrammarSpec` as a tuple, answered `(True, text, param)` with the grammar the engine gets or
`(False, message, param)`: the 400's message and the field it names. Imported by the forkserver before any worker forks, so each
worker starts with xgrammar loaded; it holds no state but what xgrammar caches."""
from __future__ import annotations

import json

import torch  # noqa: F401 - preloaded in the forkserver (xgrammar imports it)

from loraserve.engine.structured import check_spec
from loraserve.engine.types import EngineError, GrammarSpec
from loraserve.server.errors import APIError
from loraserve.server.tool_calls import FAMILIES, JSON_CALLS, TOOL_CALL, call_grammar


def settle(spec: GrammarSpec) -> str:
    """The text of the grammar the engine gets for `spec`, checked; EngineError or APIError."""
    if spec.kind != TOOL_CALL:
        check_spec(spec)
        return spec.text
    family, functions, one = json.loads(spec.text)
    text = call_grammar(JSON_CALLS if family == JSON_CALLS.name else FAMILIES[family], functions, one)
    check_spec(GrammarSpec("grammar", text, spec.param))
    return text


def serve(conn) -> None:
    """The worker's loop: until its pipe closes."""
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (True, settle(GrammarSpec(*job)), job[2])
        except (EngineError, APIError) as exc:
            answer = (False, str(exc), exc.param or job[2])
        except Exception as exc:  # noqa: BLE001 - xgrammar's parser text, as check_spec words it
            answer = (False, f"{job[2]}: the grammar does not compile: {str(exc).strip()[:300]}",
                      job[2])
        conn.send(answer)


def _warm() -> None:
    """xgrammar's first schema conversion in a process costs seconds of set-up: paid here, in
    the forkserver that preloads this module, so no worker (and no request's deadline) pays it."""
    try:
        settle(GrammarSpec("json_schema", '{"type": "object", "properties": {"w": '
                           '{"type": "string", "pattern": "^[a-z]+$"}}}', "warm"))
    except Exception:  # noqa: BLE001 - a worker then pays it
        pass


_warm()
