"""A request's log line carries strings the client chose (model, path): they can neither forge
fields or lines nor fail the log's encoder (a lone surrogate in a JSON body is legal JSON).
Seeded property test over such strings, for both formats."""
import json
import logging
import random
import re

from loraserve.server import request_log as rl

FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]+)')
NASTY = ["\udc80", "\ud800", " ", "=", "\n", "\r", "\t", "\x00", "\x1b[31m", "é", "漢", "status=500", "\u2028"]


def joined(text: str) -> str:
    """`text` with each high+low surrogate pair read as the one character JSON reads it as."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


def _record(model: str, path: str) -> rl.RequestRecord:
    return rl.RequestRecord(request_id="r1", method="POST", path=path, status=404, model=model)


def _format(fmt: logging.Formatter, rec: rl.RequestRecord) -> str:
    captured: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record)

    handler, old = Keep(), rl.access_log.level
    rl.access_log.addHandler(handler)
    rl.access_log.setLevel(logging.INFO)
    try:
        rl.write(rec)
    finally:
        rl.access_log.removeHandler(handler)
        rl.access_log.setLevel(old)
    (record,) = captured
    return fmt.format(record)


def test_client_strings_never_forge_fields_lines_or_break_the_encoder() -> None:
    rng = random.Random(7)
    for _ in range(300):
        model = "".join(rng.choice(NASTY + ["a", "b/c"]) for _ in range(rng.randint(1, 8)))
        path = "/v1/" + "".join(rng.choice(NASTY + ["x"]) for _ in range(rng.randint(0, 4)))
        rec = _record(model, path)
        text = _format(rl.TextFormatter(), rec)
        text.encode("utf-8")                       # no UnicodeEncodeError
        assert "\n" not in text and "\r" not in text  # one line
        fields = text.split("request id=r1 ", 1)[1]
        pairs = FIELD.findall(fields)
        assert " ".join(f"{k}={v}" for k, v in pairs) == fields  # the line is these fields only
        assert [k for k, _ in pairs] == ["method", "path", "status", "model"]
        values = {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}
        assert values["status"] == "404"
        assert (values["model"], values["path"]) == (joined(model), joined(path))
        line = json.loads(_format(rl.JsonFormatter(), rec))  # one parseable JSON object
        assert (line["model"], line["status"]) == (joined(model), 404)


def test_a_clean_value_reads_as_it_is() -> None:
    text = _format(rl.TextFormatter(), _record("acme/support", "/v1/completions"))
    assert "path=/v1/completions status=404 model=acme/support" in text


def test_an_audit_line_with_a_lone_surrogate_is_written_and_reads_back(tmp_path) -> None:
    from loraserve.server.audit_log import AuditLog

    path = tmp_path / "audit.jsonl"
    AuditLog(path).record(key=None, action="load", adapter="rt/\udc80x", outcome="failed", status=400)
    (line,) = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["adapter"] == "rt/\udc80x"
