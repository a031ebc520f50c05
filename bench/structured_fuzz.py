"""Structured-output fuzz: random JSON Schemas x temperatures x models (the tiny demo base and
two LoRA adapters on it, from a catalog) in process, over HTTP. Every answer that ends `stop` must be JSON (strict `json.loads`: no raw
control character in a string, no NaN) that validates against its schema (`jsonschema`, Draft
2020-12, where `format` is an annotation); an answer that ends `length` is a prefix cut by
max_tokens and is only counted. `format` asserted as well (jsonschema's FormatChecker) is
reported apart: xgrammar's format grammars are syntactic (a `date` of February 31, an `ipv4`
with a leading zero pass them), so a miss there is counted, not a failure.

    python bench/structured_fuzz.py --batches 40 --seed 0          # 40 x 8 schemas
    python bench/structured_fuzz.py --batches 200 --temperatures 0,0.7,1,1.5 --max-tokens 200

The schemas come from a hypothesis strategy (`schemas()`): enums and consts (strings with a TAB,
a quote, a backslash, a newline, non-ASCII), integers and numbers with and without bounds,
booleans, nulls, strings free, length-bounded, with a `pattern` (some holding a quote, a
backslash or a TAB, which xgrammar expands to raw characters) or a `format`; objects with 0-3
properties (odd names too), a required subset, with or without additionalProperties: false;
arrays with minItems/maxItems; anyOf; `$defs` referenced by `$ref`. Each batch's schemas are
sent at once (one engine batch), each at every temperature, through both endpoints and both
spellings (`response_format` json_schema on chat, `guided_json` on completions), the `model`
taking turns over the base and the adapters (MODELS) from one request to the next.

Prints: schemas and answers, the schemas the server refused (a 400: xgrammar cannot compile
them), answers by finish reason, the share of `stop` answers valid (must be 100%), the share
ending `length`, the same per model, and the invalid answers (schema, text, why). Exit status 1 when one `stop`
answer is invalid or an answer is neither 200 nor a 400 naming the schema's field.
`tests/server/test_structured_fuzz.py` runs a seeded bounded set.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # a checkout run without an install

import httpx  # noqa: E402
import jsonschema  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYS = ["a", "b", "id", "name", "reasoning", "answer", "x y", 'q"k', "t\tk", "\u00e9t\u00e9"]
TEXTS = ["yes", "no", "a\tb", 'say "hi"', "back\\slash", "caf\u00e9", "two\nlines", "", "\u0001"]
PATTERNS = [r"^[a-z]{1,4}$", r"^[A-Z][a-z]{0,3}$", r"^\d{2,3}$", r'^a"b$', r"^\t?x{1,2}$",
            r"^[^a]{1,3}$", r"^(ab|cd){1,2}$", r"^[\\]x$", r"^\w{1,4}$", r"^[ \t]y$",
            r'^["x]{1,2}$', r"^z.$"]
FORMATS = ["date", "email", "uuid", "ipv4", "date-time"]
TEMPERATURES = (0.0, 1.0)
BASE = "qwen3"
ADAPTERS = ("fuzz/a", "fuzz/b")  # random PEFT LoRAs on the demo base (`serve`), rank 4 and 8
MODELS = (BASE, *ADAPTERS)


# -- the schemas --------------------------------------------------------------------------------

def _integer() -> st.SearchStrategy[dict]:
    bounded = st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                        st.integers(-20, 20), st.integers(0, 30))
    return st.one_of(st.just({"type": "integer"}), bounded)


def _number() -> st.SearchStrategy[dict]:
    bounded = st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10},
                        st.integers(-5, 5))
    return st.one_of(st.just({"type": "number"}), bounded)


def _string() -> st.SearchStrategy[dict]:
    bounded = st.builds(lambda lo, span: {"type": "string", "minLength": lo,
                                          "maxLength": lo + span},
                        st.integers(0, 2), st.integers(1, 6))
    return st.one_of(
        st.just({"type": "string"}), bounded,
        st.builds(lambda lo: {"type": "string", "minLength": lo}, st.integers(1, 3)),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}))


def _enum() -> st.SearchStrategy[dict]:
    value = st.one_of(st.sampled_from(TEXTS), st.integers(-5, 99), st.booleans(), st.none())
    return st.one_of(
        st.lists(value, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
        st.sampled_from(TEXTS).map(lambda v: {"const": v}))


def _leaf(refs: list[str]) -> st.SearchStrategy[dict]:
    leaves = [_integer(), _number(), _string(), _enum(), st.just({"type": "boolean"}),
              st.just({"type": "null"})]
    if refs:
        leaves.append(st.sampled_from(refs).map(lambda name: {"$ref": f"#/$defs/{name}"}))
    return st.one_of(*leaves)


@st.composite
def _object(draw: st.DrawFn, value: st.SearchStrategy[dict]) -> dict:
    names = draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
    schema: dict[str, Any] = {"type": "object",
                              "properties": {name: draw(value) for name in names}}
    required = [n for n in names if draw(st.booleans())]
    if required:
        schema["required"] = required
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def _array(draw: st.DrawFn, value: st.SearchStrategy[dict]) -> dict:
    low = draw(st.integers(0, 2))
    schema = {"type": "array", "items": draw(value), "minItems": low}
    if draw(st.integers(0, 3)):  # mostly bounded: a random model's arrays go on otherwise
        schema["maxItems"] = low + draw(st.integers(0, 2))
    return schema


def _node(depth: int, refs: list[str]) -> st.SearchStrategy[dict]:
    if depth == 0:
        return _leaf(refs)
    inner = _node(depth - 1, refs)
    return st.one_of(_leaf(refs), _object(inner), _array(inner),
                     st.lists(inner, min_size=2, max_size=3).map(lambda s: {"anyOf": s}))


@st.composite
def schemas(draw: st.DrawFn) -> dict:
    """One random schema: `$defs` (none to two, each depth 1) the root (an object, mostly, of
    depth 2) may reference."""
    defs = {f"d{i}": draw(_node(1, [])) for i in range(draw(st.integers(0, 2)))}
    refs = list(defs)
    root = draw(st.one_of(_object(_node(1, refs)), _object(_node(1, refs)), _node(2, refs)))
    return {"$defs": defs, **root} if defs else root


# -- one answer ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Answer:
    schema: dict
    temperature: float
    model: str
    path: str
    status: int
    finish: str | None = None
    text: str = ""
    problem: str | None = None  # why a `stop` answer is invalid, or an unexpected status
    format_miss: str | None = None  # a valid `stop` answer whose `format` does not hold


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _why(validator: jsonschema.protocols.Validator, value: Any) -> str | None:
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"invalid: {error.message[:200]} at {list(error.path)}"


def check(schema: dict, text: str) -> tuple[str | None, str | None]:
    """(why `text` is not JSON valid against `schema`, why its `format`s do not hold): None
    where it is, and they do."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)  # strict: no raw controls
    except ValueError as exc:
        return f"not JSON: {exc}", None
    problem = _why(jsonschema.Draft202012Validator(schema), value)
    if problem is not None:
        return problem, None
    return None, _why(jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.FormatChecker()), value)


def ask(http: httpx.Client, schema: dict, temperature: float, chat: bool,
        max_tokens: int, seed: int, model: str = BASE) -> Answer:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": temperature, "seed": seed}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "Answer in JSON."}]
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "fuzz", "schema": schema}}
    else:
        path = "/v1/completions"
        body["prompt"] = "JSON: "
        body["guided_json"] = schema
    for _ in range(600):  # a tenant's grammars in flight are bounded: a 429 is retried, as a client would
        r = http.post(path, json=body)
        if r.status_code != 429:
            break
        time.sleep(min(float(r.headers.get("retry-after") or 0.2), 1.0))
    answer = Answer(schema, temperature, model, path, r.status_code)
    if r.status_code == 400:
        error = r.json()["error"]
        if error["param"] not in ("response_format", "guided_json"):
            answer.problem = f"400 naming {error['param']}: {error['message'][:200]}"
        else:
            answer.text = error["message"]
        return answer
    if r.status_code != 200:
        answer.problem = f"status {r.status_code}: {r.text[:300]}"
        return answer
    choice = r.json()["choices"][0]
    answer.finish = choice["finish_reason"]
    answer.text = choice["message"]["content"] if chat else choice["text"]
    if answer.finish == "stop":
        answer.problem, answer.format_miss = check(schema, answer.text)
    return answer


# -- the run ------------------------------------------------------------------------------------

@dataclass
class Report:
    schemas: int = 0
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def refused(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 400 and a.problem is None]

    @property
    def finished(self) -> Counter:
        return Counter(a.finish for a in self.answers if a.status == 200)

    @property
    def invalid(self) -> list[Answer]:
        return [a for a in self.answers if a.problem is not None]

    @property
    def format_misses(self) -> list[Answer]:
        return [a for a in self.answers if a.format_miss is not None]

    @property
    def stop_valid(self) -> int:
        return sum(a.finish == "stop" and a.problem is None for a in self.answers)

    def by_model(self) -> dict[str, Counter]:
        """model -> its `requests`, their finish reasons (`refused`: a 400), `valid` `stop`s."""
        out: dict[str, Counter] = {}
        for a in self.answers:
            seen = out.setdefault(a.model, Counter())
            seen["requests"] += 1
            refused = a.status == 400 and a.problem is None
            seen[a.finish or ("refused" if refused else f"status {a.status}")] += 1
            seen["valid"] += a.finish == "stop" and a.problem is None
        return out


def run(url: str, batches: int, batch: int = 8, seed: int = 0,
        temperatures: tuple[float, ...] = TEMPERATURES, max_tokens: int = 160,
        models: tuple[str, ...] = MODELS) -> Report:
    """`batches` hypothesis draws of `batch` schemas each; every schema at every temperature,
    its requests sent together with the batch's, each to the next of `models` in turn."""
    report = Report()
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as http, \
            ThreadPoolExecutor(batch * len(temperatures)) as pool:
        counter = iter(range(10**9))

        @settings(max_examples=batches, deadline=None, database=None, derandomize=False,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis_seed(seed)
        @given(st.lists(schemas(), min_size=batch, max_size=batch))
        def one_batch(drawn: list[dict]) -> None:
            jobs = []  # (schema, temperature, chat, seed, model)
            for i, s in enumerate(drawn):
                for k, t in enumerate(temperatures):
                    n = next(counter)
                    jobs.append((s, t, (i + k) % 2 == 0, n, models[n % len(models)]))
            report.schemas += len(drawn)
            report.answers += pool.map(lambda j: ask(http, *j[:3], max_tokens, *j[3:]), jobs)

        one_batch()
    report.seconds = time.perf_counter() - started
    return report


def print_report(report: Report, out=sys.stdout) -> None:
    answers = [a for a in report.answers if a.status == 200]
    finished = report.finished
    stop = finished.get("stop", 0)
    print(f"schemas {report.schemas}, requests {len(report.answers)} in {report.seconds:.0f} s; "
          f"refused (400, the schema does not compile) {len(report.refused)}", file=out)
    print(f"answers {len(answers)}: " + ", ".join(f"{k} {v}" for k, v in finished.most_common())
          + f"; ending `length` {finished.get('length', 0) / max(len(answers), 1):.1%}", file=out)
    print(f"`stop` answers valid: {report.stop_valid}/{stop} "
          f"({report.stop_valid / max(stop, 1):.1%})", file=out)
    for model, seen in sorted(report.by_model().items()):
        print(f"  {model}: {seen['requests']} requests, `stop` valid {seen['valid']}/"
              f"{seen['stop']}, `length` {seen['length']}, refused {seen['refused']}", file=out)
    misses = report.format_misses
    print(f"`format` asserted too: {len(misses)} of them miss it" + "".join(
        f"\n  {a.format_miss[9:90]}" for a in misses[:5]), file=out)
    reasons = Counter(a.text.split(":", 2)[-1].strip()[:90] for a in report.refused)
    for reason, n in reasons.most_common(5):
        print(f"  refused x{n}: {reason}", file=out)
    for a in report.invalid[:10]:
        print(f"INVALID {a.model} {a.path} t={a.temperature}: {a.problem}\n  schema {json.dumps(a.schema)}"
              f"\n  text   {a.text!r}", file=out)


def serve(model_dir: str, root: Path):
    """A live server over the demo base and ADAPTERS, in this process (tests/server/live.py's);
    the adapters' PEFT directories and their catalog are written under `root`."""
    from loraserve.demo import import_demo_adapters
    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.server import build_app
    sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
    from server.adapter_files import write_peft
    from server.live import LiveServer

    peft = {ref: write_peft(root / "peft" / ref, Path(model_dir), r=4 * (i + 1), seed=i)
            for i, ref in enumerate(ADAPTERS)}
    import_demo_adapters(root / "catalog", peft, Path(model_dir))
    engine = AsyncEngine.from_model_dir(model_dir, catalog_dir=str(root / "catalog"),
                                        device="cpu", dtype="float32", max_model_len=512,
                                        max_batch_size=32, max_lora_rank=8,
                                        served_model_name=BASE)
    return LiveServer(build_app(engine))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="schemas sent together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", help="base directory (default: the demo base, built once)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"the models requests take turns over (of {', '.join(MODELS)})")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from loraserve.demo import build_demo_base
        model = str(build_demo_base(Path(tempfile.gettempdir()) / "loraserve-fuzz" / "qwen3"))
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    with tempfile.TemporaryDirectory(prefix="loraserve-fuzz-") as adapters, \
            serve(model, Path(adapters)) as live:
        report = run(live.url, args.batches, args.batch, args.seed, temperatures,
                     args.max_tokens, tuple(args.models.split(",")))
    print_report(report)
    return 1 if report.invalid else 0


if __name__ == "__main__":
    sys.exit(main())
