"""JSON out with orjson: answers and SSE events of the generation endpoints.

The stdlib encoder costs ~10 us per streamed chunk on this project's 2-core reference box,
orjson ~1 us (bench/hot_path.py; bench/RESULTS.md). Output differs only in spacing (compact)
and in what json.dumps would refuse or write as invalid JSON (NaN: null here; logprobs are
floored before they get here anyway). Non-str keys are written as strings, as json.dumps does.
"""
from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse

_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumps(obj: Any) -> str:
    return orjson.dumps(obj, option=_OPTIONS).decode()


class FastJSONResponse(JSONResponse):
    """starlette's JSONResponse, rendered by orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_OPTIONS)
