"""Aliases: other names of adapter revisions, e.g. the URI a training service exported a
checkpoint under (`tinker://<run-id>/sampler_weights/<checkpoint>`, run ids hold `:`).

An alias is a URI (`scheme://rest`, at most ALIAS_MAX characters, no whitespace or control
characters) and names exactly one revision, `tenant/name@revision`, for good: re-recording the
same alias for the same revision is a no-op, for another revision it is AliasConflict (409).

Storage: the `meta` db of the shard the alias hashes to, under `alias:` + SHA-256(alias) hex
(LMDB keys are short; the alias itself is kept in the JSON value and compared on read). The
shards' own fault handling applies: a damaged shard raises ShardUnavailable for its aliases.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re

from .errors import CatalogError
from .ids import parse_model_ref, validate_adapter_id, validate_revision
from .shards import shard_of
from .store import Catalog

ALIAS_MAX = 512
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\x00-\x1f\x7f]+")


class InvalidAlias(CatalogError):
    """An alias that is not a URI (or is too long)."""

    status = 400


class AliasConflict(CatalogError):
    """The alias already names another revision."""

    status = 409


def is_alias(name: str) -> bool:
    """Whether `name` has an alias's shape (a URI): only such names are looked up."""
    return "://" in name


def validate_alias(alias: str) -> str:
    """`alias` if it is a valid alias (module doc); else InvalidAlias."""
    if not isinstance(alias, str) or len(alias) > ALIAS_MAX or not _URI.fullmatch(alias):
        raise InvalidAlias(f"invalid alias {str(alias)[:ALIAS_MAX]!r}: expected a URI such as "
                           f"tinker://<run-id>/sampler_weights/<checkpoint> (at most {ALIAS_MAX} "
                           "characters, no whitespace)")
    return alias


def _key(alias: str) -> bytes:
    return b"alias:" + hashlib.sha256(alias.encode("utf-8")).hexdigest().encode()


def _read_alias(txn, dbs, alias: str) -> str | None:
    raw = txn.get(_key(alias), db=dbs.meta)
    if raw is None:
        return None
    record = json.loads(bytes(raw))
    return record["ref"] if record.get("alias") == alias else None


def lookup_alias(catalog: Catalog, alias: str) -> str | None:
    """The `tenant/name@revision` that `alias` names; None when it names none (or is no URI).
    The txn body is a module-level function, so an IsolatedCatalog's shard host can run it."""
    if not is_alias(alias) or len(alias) > ALIAS_MAX:
        return None
    read = functools.partial(_read_alias, alias=alias)
    return catalog.shard(shard_of(alias, catalog.shards)).read(read, default=None)


def record_alias(catalog: Catalog, alias: str, adapter_id: str, revision: str) -> str:
    """Record `alias` as a name of `adapter_id@revision` (which must exist: AdapterNotFound or
    RevisionNotFound otherwise); returns that ref. AliasConflict if it names another one."""
    validate_alias(alias)
    validate_adapter_id(adapter_id)
    validate_revision(revision)
    ref = catalog.resolve(adapter_id, revision).ref  # a tag resolves to its revision id
    # a module-level body, so an IsolatedCatalog's shard host can run it (it pickles the call)
    write = functools.partial(_write_alias, alias=alias, ref=ref)
    return catalog.shard(shard_of(alias, catalog.shards)).write(write)


def _write_alias(txn, dbs, alias: str, ref: str) -> str:
    raw = txn.get(_key(alias), db=dbs.meta)
    if raw is not None:
        held = json.loads(bytes(raw)).get("ref")
        if held != ref:
            raise AliasConflict(f"alias {alias!r} already names {held}, not {ref}")
        return ref
    txn.put(_key(alias), json.dumps({"alias": alias, "ref": ref}, separators=(",", ":")).encode(), db=dbs.meta)
    return ref


def check_alias_free(catalog: Catalog, alias: str, adapter_id: str) -> None:
    """Before an import: InvalidAlias for a bad alias, AliasConflict when it names a revision of
    another adapter (one of the same adapter is checked again when it is recorded)."""
    validate_alias(alias)
    held = lookup_alias(catalog, alias)
    if held is not None and parse_model_ref(held)[0] != adapter_id:
        raise AliasConflict(f"alias {alias!r} already names {held}")
