"""API keys: the keys file (TOML), the principal each key stands for, the tenants' shares and
limits, and the immutable KeyStore a server swaps whole when the file is re-read.

A key is never stored, only the SHA-256 of its UTF-8 bytes (64 hex digits):

    [tenants.acme]                # optional: the tenant's share and limits, for all its keys
    weight = 2.0                  #   fair-share weight in the scheduler (default: the key's, 1)
    max_concurrent = 8            #   sequences in flight,
    requests_per_second = 5       #   requests per second (token bucket, burst of one second),
    tokens_per_minute = 100000    #   prompt + generated tokens per minute (token bucket)

    [keys.acme-prod]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    role = "user"                 # user | admin
    tenants = ["acme"]            # or "*": every tenant (an admin's default)
    load = true                   # optional: may load/unload/promote/rollback in its tenants
    weight = 2.0                  # optional: fair-share weight where its tenant sets none
    max_concurrent = 2            # optional: this key's own limits, in each tenant it uses,
    requests_per_second = 1       #   on top of the tenant's (the same three fields)

A `[tenants.<name>]` table's limits are kept per tenant: every key's requests charged to the
tenant count against them together, so a second key of a tenant adds nothing to what the tenant
may use. A key's own limits are kept per (key, tenant) and only ever tighten the tenant's. (Until
tenant tables existed, the limits on a key were the only ones; a file that still has them there
keeps them as each key's own: put the tenant's in `[tenants.<name>]`.)

Anything else (an unknown field or table, a wrong type, a hash that is not 64 hex digits, an
unknown role, two entries with one hash, a tenant name that is not one) makes the whole file
invalid: `load_keys` raises KeyFileError with a one-line reason, and a server keeps the store
it had.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraserve.catalog.errors import InvalidAdapterId
from loraserve.catalog.ids import validate_adapter_id

KEY_PREFIX = "tml-"  # the Tinker SDK refuses any other; MinT's SDK (on tinker) takes it too
ALL_TENANTS = "*"
ROLES = ("user", "admin")
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_KEY_PREFIX = re.compile(r"tml-[A-Za-z0-9_-]{0,12}")
_LIMIT_FIELDS = ("max_concurrent", "requests_per_second", "tokens_per_minute")
_FIELDS = {"sha256", "role", "tenants", "load", "weight", *_LIMIT_FIELDS}
_TENANT_FIELDS = {"weight", *_LIMIT_FIELDS}


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message is one line naming the file and the entry."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits (all its keys together), or a key's own in each tenant; None =
    unlimited."""

    max_concurrent: int | None = None          # sequences in flight
    requests_per_second: float | None = None   # token bucket, capacity max(1, rate)
    # token bucket: prompt + max_tokens taken at admission, what was not generated given back
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        rps = self.requests_per_second
        if rps is not None and not (math.isfinite(rps) and rps > 0):
            raise ValueError(f"requests_per_second must be a finite number > 0, got {rps}")
        if self.tokens_per_minute is not None and self.tokens_per_minute < 1:
            raise ValueError(f"tokens_per_minute must be >= 1, got {self.tokens_per_minute}")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.max_concurrent, self.requests_per_second,
                                           self.tokens_per_minute))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: a key's id, role, tenants and limits.

    An admin may do everything. A user may use the base model and the adapters of its tenants,
    and with `load` also load, unload, promote and roll back adapters there. `OPEN` stands for
    every request of a server without keys.
    """

    key_id: str | None
    admin: bool
    tenants: tuple[str, ...] = (ALL_TENANTS,)
    load: bool = False
    weight: float = 1.0
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        for tenant in self.tenants:
            if tenant != ALL_TENANTS:
                check_tenant(tenant)
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight}")

    def sees(self, tenant: str) -> bool:
        """Whether this key may use (and see) the adapters of `tenant`."""
        return self.admin or ALL_TENANTS in self.tenants or tenant in self.tenants

    def may_control(self, tenant: str) -> bool:
        """Whether this key may load, unload, promote or roll back adapters of `tenant`."""
        return self.admin or (self.load and self.sees(tenant))

    @property
    def home_tenant(self) -> str:
        """The tenant a base-model request is charged to: the first listed ("" for "*")."""
        first = self.tenants[0] if self.tenants else ALL_TENANTS
        return "" if first == ALL_TENANTS else first


OPEN = Principal(key_id=None, admin=True)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's `[tenants.<name>]` table: its fair-share weight (None: the key's) and its
    limits, which every key charged to the tenant shares."""

    weight: float | None = None
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight}")


NO_POLICY = TenantPolicy()


def check_tenant(tenant: str) -> str:
    """`tenant` if it is a valid tenant part of an adapter id; else ValueError."""
    try:
        validate_adapter_id(f"{tenant}/x")
    except InvalidAdapterId:
        raise ValueError(f"invalid tenant {tenant!r}: letters, digits, '.', '_', '-' "
                         "(at most 64), and not '.' or '..'") from None
    return tenant


def digest(key: str) -> bytes:
    """SHA-256 of a key's UTF-8 bytes (what a keys file stores, in hex)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class KeyEntry:
    principal: Principal
    digest: bytes  # 32 bytes


@dataclass(frozen=True, slots=True)
class KeyStore:
    """The keys a server accepts. Immutable: a reload builds a new one and swaps it in whole."""

    entries: tuple[KeyEntry, ...] = ()
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: dict[bytes, str | None] = {}
        for e in self.entries:
            if e.digest in seen:
                raise ValueError(f"keys {seen[e.digest]!r} and {e.principal.key_id!r} have "
                                 "the same sha256")
            seen[e.digest] = e.principal.key_id

    def __len__(self) -> int:
        return len(self.entries)

    def find(self, key: str) -> Principal | None:
        """The principal of `key`, or None. Every entry is compared (hmac.compare_digest on
        the digests), so the time taken does not depend on which entry matches."""
        given = digest(key)
        found = None
        for entry in self.entries:
            if hmac.compare_digest(given, entry.digest):
                found = entry.principal
        return found

    def with_entry(self, entry: KeyEntry) -> KeyStore:
        return KeyStore((*self.entries, entry), self.tenants)

    def tenant(self, name: str) -> TenantPolicy:
        """The policy of tenant `name` (NO_POLICY when the file has no table for it)."""
        return self.tenants.get(name, NO_POLICY)


def load_keys(path: str | os.PathLike) -> KeyStore:
    """Parse and check a keys file (module doc); KeyFileError with a one-line reason."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise KeyFileError(f"keys file {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"keys file {path}: malformed TOML: {_one_line(exc)}") from None
    try:
        return parse_keys(doc)
    except ValueError as exc:
        raise KeyFileError(f"keys file {path}: {_one_line(exc)}") from None


def parse_keys(doc: dict[str, Any]) -> KeyStore:
    """The KeyStore of a parsed keys document; ValueError naming the entry at fault."""
    unknown = sorted(set(doc) - {"keys", "tenants"})
    if unknown:
        raise ValueError(f"unknown table {unknown[0]!r} (only [keys.<id>] and "
                         "[tenants.<name>] tables are allowed)")
    tenants = {}
    for name, fields in _table(doc, "tenants", "[tenants.<name>] tables").items():
        try:
            tenants[name] = parse_tenant(name, fields)
        except ValueError as exc:
            raise ValueError(f"[tenants.{name}]: {exc}") from None
    entries = []
    for key_id, fields in _table(doc, "keys", "[keys.<id>] entries").items():
        try:
            entries.append(parse_entry(key_id, fields))
        except ValueError as exc:
            raise ValueError(f"[keys.{key_id}]: {exc}") from None
    return KeyStore(tuple(entries), tenants)


def _table(doc: dict[str, Any], name: str, what: str) -> dict[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ValueError(f"{name!r} must be a table of {what}")
    return table


def parse_tenant(name: str, fields: Any) -> TenantPolicy:
    """One `[tenants.<name>]` table as a TenantPolicy; ValueError on anything wrong or unknown."""
    check_tenant(name)
    if not isinstance(fields, dict):
        raise ValueError("must be a table")
    unknown = sorted(set(fields) - _TENANT_FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (a tenant has weight, "
                         f"{', '.join(_LIMIT_FIELDS)})")
    return TenantPolicy(weight=_number(fields, "weight"), limits=_limits(fields))


def _limits(fields: dict[str, Any]) -> Limits:
    return Limits(max_concurrent=_typed(fields, "max_concurrent", int),
                  requests_per_second=_number(fields, "requests_per_second"),
                  tokens_per_minute=_typed(fields, "tokens_per_minute", int))


def parse_entry(key_id: str, fields: Any) -> KeyEntry:
    """One `[keys.<id>]` table as a KeyEntry; ValueError on anything wrong or unknown."""
    if not _KEY_ID.fullmatch(key_id):
        raise ValueError("a key id is 1-64 letters, digits, '.', '_' or '-'")
    if not isinstance(fields, dict):
        raise ValueError("must be a table")
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    sha = _typed(fields, "sha256", str, required=True)
    if not _SHA256_HEX.fullmatch(sha.lower()):
        raise ValueError("sha256 must be 64 hex digits (the SHA-256 of the key, never the key)")
    role = _typed(fields, "role", str, required=True)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (user or admin)")
    tenants = fields.get("tenants", ALL_TENANTS if role == "admin" else None)
    if tenants is None:
        raise ValueError("a user key needs tenants (a list of tenant names, or \"*\")")
    if tenants == ALL_TENANTS:
        tenants = [ALL_TENANTS]
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise ValueError("tenants must be a list of tenant names, or \"*\"")
    if not tenants:
        raise ValueError("a key needs at least one tenant (or \"*\")")
    limits = _limits(fields)
    weight = _number(fields, "weight")
    principal = Principal(key_id=key_id, admin=role == "admin", tenants=tuple(tenants),
                          load=_typed(fields, "load", bool) or False,
                          weight=1.0 if weight is None else weight, limits=limits)
    return KeyEntry(principal, bytes.fromhex(sha))


def _typed(fields: dict[str, Any], name: str, kind: type, required: bool = False) -> Any:
    value = fields.get(name)
    if value is None:
        if required:
            raise ValueError(f"missing field {name!r}")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{name} must be {_KINDS[kind]}, got {value!r}")
    return value


_KINDS = {str: "a string", int: "an integer", bool: "true or false"}


def _number(fields: dict[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return None if value is None else float(value)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# -- creating keys -------------------------------------------------------------------------------

def new_key(prefix: str = KEY_PREFIX) -> str:
    """A fresh random key: `prefix` and 43 URL-safe characters (256 bits).

    Every key starts with `tml-`: the Tinker SDK refuses a key without it (`ApiKeyAuthProvider`:
    "The api_key must start with the 'tml-' prefix"), and the MinT SDK, built on it, takes it
    too. So `prefix` is `tml-` and at most 12 more letters, digits, '_' or '-' (`tml-acme-`)."""
    if not _KEY_PREFIX.fullmatch(prefix):
        raise KeyFileError(f"invalid key prefix {prefix!r}: 'tml-' (the Tinker SDK takes no other) "
                           "and at most 12 more letters, digits, '_', '-'")
    return prefix + secrets.token_urlsafe(32)


def entry_toml(principal: Principal, sha256_hex: str) -> str:
    """The `[keys.<id>]` table of an entry, as text to append to a keys file."""
    p, lim = principal, principal.limits
    lines = [f"[keys.{json.dumps(p.key_id)}]", f"sha256 = {json.dumps(sha256_hex)}",
             f"role = {json.dumps('admin' if p.admin else 'user')}",
             "tenants = " + (json.dumps(ALL_TENANTS) if ALL_TENANTS in p.tenants
                             else json.dumps(list(p.tenants)))]
    if p.load:
        lines.append("load = true")
    if p.weight != 1.0:
        lines.append(f"weight = {p.weight!r}")
    for name in ("max_concurrent", "requests_per_second", "tokens_per_minute"):
        value = getattr(lim, name)
        if value is not None:
            lines.append(f"{name} = {value!r}")
    return "\n".join(lines) + "\n"


def append_key(path: str | os.PathLike, principal: Principal, prefix: str = KEY_PREFIX) -> str:
    """Make a new key for `principal`, append its entry (the hash only) to the keys file at
    `path` (created with mode 0600 if missing) and return the key, which is stored nowhere.

    The file must be valid before (KeyFileError otherwise) and the key id new in it."""
    path = Path(path)
    store = load_keys(path) if path.exists() else KeyStore()
    if any(e.principal.key_id == principal.key_id for e in store.entries):
        raise KeyFileError(f"keys file {path}: a key with id {principal.key_id!r} exists")
    key = new_key(prefix)
    text = entry_toml(principal, digest(key).hex())
    try:  # check the entry before the file is touched
        parse_keys(tomllib.loads(text))
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise KeyFileError(f"key {principal.key_id!r}: {_one_line(exc)}") from None
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if f.tell() > 0:
            f.write("\n")
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    load_keys(path)  # the file as written must read back
    return key


# -- listing, revoking, rotating -----------------------------------------------------------------
# The file is edited as text, table by table, so comments and the layout of the other entries
# stay as they were; every edit is checked by parsing the result (only the intended entry may
# differ) before the file is replaced, atomically and with its mode kept.

_HEADER = re.compile(r"\s*\[")  # a table or array-of-tables header starts a new section


def _key_header(key_id: str) -> re.Pattern[str]:
    quoted = re.escape(key_id)
    return re.compile(rf'\s*\[\s*keys\s*\.\s*(?:{quoted}|"{quoted}"|\'{quoted}\')\s*\]\s*(?:#.*)?')


def _section(lines: list[str], key_id: str, path: Path) -> tuple[int, int]:
    """[start, end) of the lines of `[keys.<key_id>]` (header to the next header); KeyFileError
    when the key is not written as one table of its own."""
    header = _key_header(key_id)
    starts = [i for i, line in enumerate(lines) if header.fullmatch(line.rstrip("\n"))]
    if len(starts) != 1:
        raise KeyFileError(f"keys file {path}: no [keys.{key_id}] table to edit (edit the file "
                           "by hand if the key is written another way)")
    end = next((i for i in range(starts[0] + 1, len(lines)) if _HEADER.match(lines[i])),
               len(lines))
    return starts[0], end


def _replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (temporary file, fsync, rename), keeping its mode."""
    mode = path.stat().st_mode & 0o777
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _edited(path: Path, text: str, expect: KeyStore) -> None:
    """Check that `text` parses to exactly `expect`, then write it over `path`."""
    try:
        got = parse_keys(tomllib.loads(text))
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise KeyFileError(f"keys file {path}: the edit would not parse ({_one_line(exc)}); "
                           "file left as it was") from None
    if got != expect:
        raise KeyFileError(f"keys file {path}: the edit would change other entries; file left "
                           "as it was (edit it by hand)")
    _replace_file(path, text)


def _entry(store: KeyStore, key_id: str, path: Path) -> KeyEntry:
    for e in store.entries:
        if e.principal.key_id == key_id:
            return e
    raise KeyFileError(f"keys file {path}: no key with id {key_id!r}")


def revoke_key(path: str | os.PathLike, key_id: str) -> KeyEntry:
    """Remove the entry of `key_id` from the keys file; returns it. A running server refuses
    the key (401) from its next reload (SIGHUP or `POST /admin/reload-keys`) on."""
    path = Path(path)
    store = load_keys(path)
    gone = _entry(store, key_id, path)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    start, end = _section(lines, key_id, path)
    rest = KeyStore(tuple(e for e in store.entries if e is not gone), store.tenants)
    _edited(path, "".join(lines[:start] + lines[end:]), rest)
    return gone


def rotate_key(path: str | os.PathLike, key_id: str, prefix: str = KEY_PREFIX) -> str:
    """Give `key_id` a new key (same role, tenants and limits), write its hash in place of the
    old one and return it (stored nowhere). The old key is refused from the next reload on."""
    path = Path(path)
    store = load_keys(path)
    old = _entry(store, key_id, path)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    start, end = _section(lines, key_id, path)
    sha_line = re.compile(r'(\s*sha256\s*=\s*)(["\'])[0-9A-Fa-f]{64}\2(.*)', re.DOTALL)
    at = [i for i in range(start, end) if sha_line.fullmatch(lines[i])]
    if len(at) != 1:
        raise KeyFileError(f"keys file {path}: [keys.{key_id}] has no one-line sha256 to replace")
    key = new_key(prefix)
    new = KeyEntry(old.principal, digest(key))
    lines[at[0]] = sha_line.sub(lambda m: f'{m[1]}"{new.digest.hex()}"{m[3]}', lines[at[0]])
    expect = KeyStore(tuple(new if e is old else e for e in store.entries), store.tenants)
    _edited(path, "".join(lines), expect)
    return key
