"""What keeps a test run whole whatever its tests provoke (used by the root conftest): the root
logger restored after each test, and reports xdist can send."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from loraserve.textsafe import encodable


@contextlib.contextmanager
def root_logger_restored() -> Iterator[None]:
    """A test that runs `loraserve serve` in process (cli._serve calls configure_logging) would
    leave the root logger writing to that test's captured stderr, closed once it ends, and at
    its level: every later log line of the worker then fails to write, and records of other
    tests' servers land in this worker's captured logs. Each test gets the root logger back as
    it found it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def encodable_report(report: pytest.TestReport) -> None:
    """A report's captured output and failure text as UTF-8 can carry them. xdist sends reports
    through execnet, which encodes str strictly: one lone surrogate (a fuzzer's adapter id in a
    captured log line) would end the worker's session mid-run and abort the whole test run
    with an INTERNALERROR. The escape is the one the server's own logs use."""
    report.sections = [(name, encodable(text)) for name, text in report.sections]
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        if encodable(text) != text:
            report.longrepr = encodable(text)
