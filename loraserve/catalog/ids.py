"""Adapter ids and model references: validation only, never filesystem paths.

Rules (DESIGN.md): an adapter id is `tenant/name`; both parts use ASCII letters, digits,
`.`, `_`, `-`; tenant <= 64 chars, name <= 128 chars. A model reference is an adapter id,
optionally followed by `@rev` where `rev` is a revision id or a tag. The parts `.` and `..`
are refused too, so an id can never be mistaken for a relative path.
"""
from __future__ import annotations

import re

from .errors import InvalidAdapterId

_PART = re.compile(r"[A-Za-z0-9._-]+")
TENANT_MAX = 64
NAME_MAX = 128
REVISION_MAX = 64
# the tenant of an adapter named without one (vLLM's habit: `lora_name: "sql-lora"`,
# `--lora-modules sql-lora=DIR`, `"model": "sql-lora"`): `default/sql-lora`
DEFAULT_TENANT = "default"


def _check_part(value: str, what: str, max_len: int, whole: str) -> None:
    if not value:
        raise InvalidAdapterId(f"invalid {what} in {whole!r}: empty")
    if len(value) > max_len:
        raise InvalidAdapterId(f"invalid {what} in {whole!r}: longer than {max_len} chars")
    if not _PART.fullmatch(value):
        raise InvalidAdapterId(
            f"invalid {what} in {whole!r}: only ASCII letters, digits, '.', '_', '-' are allowed"
        )
    if value in (".", ".."):
        raise InvalidAdapterId(f"invalid {what} in {whole!r}: {value!r} is not allowed")


def validate_adapter_id(s: str) -> str:
    """Return `s` unchanged if it is a valid `tenant/name` adapter id; else InvalidAdapterId."""
    if not isinstance(s, str):
        raise InvalidAdapterId(f"adapter id must be a string, got {type(s).__name__}")
    parts = s.split("/")
    if len(parts) != 2:
        raise InvalidAdapterId(f"invalid adapter id {s!r}: expected 'tenant/name'")
    _check_part(parts[0], "tenant", TENANT_MAX, s)
    _check_part(parts[1], "name", NAME_MAX, s)
    return s


def validate_revision(s: str, what: str = "revision") -> str:
    """Return `s` if it is a valid revision id or tag name (same charset, <= 64 chars)."""
    if not isinstance(s, str):
        raise InvalidAdapterId(f"{what} must be a string, got {type(s).__name__}")
    _check_part(s, what, REVISION_MAX, s)
    return s


def parse_model_ref(s: str) -> tuple[str, str | None]:
    """Split a model reference: `"t/n"` -> `("t/n", None)`; `"t/n@r3"` -> `("t/n", "r3")`."""
    if not isinstance(s, str):
        raise InvalidAdapterId(f"model reference must be a string, got {type(s).__name__}")
    adapter_id, sep, rev = s.partition("@")
    validate_adapter_id(adapter_id)
    if not sep:
        return adapter_id, None
    if "@" in rev:
        raise InvalidAdapterId(f"invalid model reference {s!r}: more than one '@'")
    return adapter_id, validate_revision(rev)


def with_default_tenant(name: str) -> str:
    """`name` with the default tenant in front when it names no tenant (`sql-lora`,
    `sql-lora@r2` -> `default/sql-lora[@r2]`); any other name unchanged. Only the adapter part
    (before any `@`) is looked at, so a tag holding a `/` is no tenant."""
    return name if "/" in name.split("@", 1)[0] else f"{DEFAULT_TENANT}/{name}"
