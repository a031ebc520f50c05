"""Structured output valid by construction (issue 43): random JSON Schemas (enums, nested
objects, arrays with minItems/maxItems, string patterns and lengths, anyOf, $ref/$defs, required
subsets) x temperatures x models (the tiny demo base and two adapters on it), in process: every
answer that ends `stop` parses with strict `json.loads` and validates with `jsonschema`. The
driver and the schema strategy are `bench/structured_fuzz.py` (a long run: `--batches 250`);
here a seeded bounded set.

Before the grammar's strings were made JSON (structured.json_safe_strings), 28 of 876 `stop`
answers of the bench's `--batches 40 --seed 1 --temperatures 0,0.7,1.5` run failed: a raw TAB
or another control character in a length-bounded string or an enum-free pattern, a raw `\\` from
a pattern, a surrogate's bytes making a 5-character string 8 characters long.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "structured_fuzz.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("structured_fuzz", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz():
    return load_driver()


def test_every_stop_answer_is_valid_json_of_its_schema(fuzz, demo_dense, tmp_path) -> None:
    with fuzz.serve(str(demo_dense), tmp_path) as live:
        report = fuzz.run(live.url, batches=10, batch=8, seed=0, temperatures=(0.0, 1.0),
                          max_tokens=160)
    fuzz.print_report(report)  # shown with -s, or when the test fails
    assert not report.invalid, [(a.problem, a.schema, a.text) for a in report.invalid[:5]]
    answers = sum(report.finished.values())
    assert len(report.answers) == 160 and answers + len(report.refused) == 160
    assert report.finished["stop"] >= 0.6 * answers  # most answers complete: not a vacuous check
    by_model = report.by_model()  # the base and each adapter in turn: 160 / 3 requests each
    assert sorted(by_model) == sorted(fuzz.MODELS) and len(fuzz.MODELS) == 3
    for model, seen in by_model.items():
        assert seen["requests"] in (53, 54) and seen["stop"] >= 0.5 * seen["requests"], (model, seen)


@pytest.mark.parametrize(("schema", "text", "valid"), [
    ({"type": "string", "maxLength": 3}, '"a\tb"', False),  # a raw TAB: not JSON
    ({"type": "string", "maxLength": 3}, '"a\\tb"', True),
    ({"type": "string"}, '"caf\u00e9"', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     '{"a": "1"}', False),
    ({"type": "number"}, "NaN", False),
])
def test_the_checker_itself(fuzz, schema: dict, text: str, valid: bool) -> None:
    assert (fuzz.check(schema, text)[0] is None) is valid
