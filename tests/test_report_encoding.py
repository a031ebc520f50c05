"""The test run survives what the tests provoke: a lone surrogate (the fuzzers send them as
adapter ids) in a test's captured output or failure text must not end an xdist worker
(conftest.encodable_report), and no test leaves the root logger changed (conftest)."""
from __future__ import annotations

import logging

import pytest
from _pytest.reports import TestReport
from execnet.gateway_base import DumpError, dumps

from run_guards import encodable_report, root_logger_restored
from loraserve.cli import main


def _report(sections: list[tuple[str, str]], longrepr: object = None) -> TestReport:
    return TestReport("t.py::t", ("t.py", 1, "t"), {}, "failed" if longrepr else "passed",
                      longrepr, "call", sections=sections)


def test_a_surrogate_in_captured_output_or_a_failure_travels_escaped() -> None:
    report = _report([("Captured log call", "adapter acme/\udc80 failed")],
                     longrepr="AssertionError: 'x\ud800' != 'x'")
    with pytest.raises(DumpError):
        dumps(report.sections)  # what xdist would have sent
    encodable_report(report)
    assert report.sections == [("Captured log call", "adapter acme/\\udc80 failed")]
    assert report.longrepr == "AssertionError: 'x\\ud800' != 'x'"
    dumps((report.sections, report.longrepr))
    clean = _report([("Captured stdout call", "plain ü")])
    encodable_report(clean)
    assert clean.sections == [("Captured stdout call", "plain ü")]


def test_a_surrogate_logged_by_a_test_reaches_the_report(caplog) -> None:
    logging.getLogger("loraserve.test").warning("adapter %s failed", "acme/\udc80")
    assert "acme/\udc80" in caplog.text  # captured raw; the report hook escapes it


def test_serve_in_process_leaves_the_root_logger_as_it_found_it() -> None:
    root = logging.getLogger()
    before = root.handlers[:], root.level
    with root_logger_restored():  # what every test runs under (conftest's autouse fixture)
        assert main(["serve", "--log-level", "debug", "--max-connections", "1000000000",
                     "--model", "/nonexistent"]) == 1  # logging configured, then the flag refused
        assert root.level == logging.DEBUG and root.handlers != before[0]
    assert (root.handlers, root.level) == before
