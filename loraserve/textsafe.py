"""Text that a UTF-8 stream can always take: one place for the escape the logs, error bodies and
test reports share (dependency-free, so a test run without the server's packages can use it)."""
from __future__ import annotations


def encodable(text: str) -> str:
    """`text` as a UTF-8 stream can take it: a lone surrogate (a client's JSON may carry one)
    becomes its backslash escape (U+DC80 reads `\\udc80`) instead of an UnicodeEncodeError in
    the log handler."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
