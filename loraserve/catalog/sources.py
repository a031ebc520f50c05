"""Adapter sources: where an adapter id the catalog lacks may be fetched from, in order.

A source is a URI template with `{tenant}` and `{name}` (`--adapter-source`, repeatable):

    s3://bucket/adapters/{tenant}/{name}    an S3-compatible bucket (fetchers.S3Fetcher)
    hf://{tenant}/{name}                    a Hugging Face Hub repository (fetchers.HubFetcher)
    /srv/adapters/{tenant}/{name}           a local directory (file:// too), confined to the
                                            part of the template before its first field

A template is filled from the id a request names (`acme/support` -> `.../acme/support`), and
only after the caller has checked that the requesting key sees that id's tenant; a URI given to
`/v1/load_lora_adapter` must match a template, and the id it fills must be the one loaded. So
a source never yields an adapter outside the tenants of the key that asked for it.

`AdapterSources.fetch(adapter_id, into)` tries the sources in order and hands the first PEFT
directory found (`adapter_config.json`, `adapter_model.safetensors`, verified by the fetcher:
see fetchers) to `into`, which exports it against the base and writes it as a revision. It is
blocking (callers run it on a thread) and single-flight per id: concurrent misses for one id
fetch it once and share the outcome. A miss in every source is remembered for
`negative_ttl_s`, so a hot unknown name does not become a store request each time.

Errors: no source has it -> SourceNotFound (404); a source is down and none had it ->
SourceUnavailable (503); a bad adapter -> ExportError (400) naming why; too large -> 413.
"""
from __future__ import annotations

import re
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from .base import BaseInfo
from .errors import CatalogError, InvalidAdapterId, SourceForbidden, SourceNotFound, SourceUnavailable
from .format import blob_checksum
from .ids import NAME_MAX, TENANT_MAX, validate_adapter_id
from .importer import Admit, import_peft
from .lru import BoundedLRU
from .records import RevisionRecord
from .source import AdapterSource
from .store import Catalog

T = TypeVar("T")
SCHEMES = ("s3", "hf", "file")
_FIELD = {"tenant": rf"(?P<tenant>[A-Za-z0-9._-]{{1,{TENANT_MAX}}})",
          "name": rf"(?P<name>[A-Za-z0-9._-]{{1,{NAME_MAX}}})"}


class Fetcher(Protocol):
    """Makes the PEFT directory at `location` readable: downloads it into `workdir` (verified)
    or confines a local one; at most `max_bytes` in all."""

    def open(self, location: str, workdir: Path, max_bytes: int) -> AdapterSource: ...


class Template:
    """One source URI template: `fill` an id into a location, `match` a URI back to its id."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        scheme, sep, rest = uri.partition("://")
        if not sep:
            scheme, rest = "file", uri
        if scheme not in SCHEMES:
            raise CatalogError(f"adapter source {uri!r}: scheme must be one of {', '.join(SCHEMES)}")
        if rest.count("{tenant}") != 1 or rest.count("{name}") != 1:
            raise CatalogError(f"adapter source {uri!r} must hold {{tenant}} and {{name}} once each")
        if re.search(r"\{(?!tenant\}|name\})", rest):
            raise CatalogError(f"adapter source {uri!r}: only the fields {{tenant}} and {{name}} exist")
        self.scheme, self.path = scheme, rest
        parts = re.split(r"(\{tenant\}|\{name\})", rest)
        self._pattern = re.compile("".join(_FIELD[p[1:-1]] if p in ("{tenant}", "{name}") else re.escape(p)
                                           for p in parts))
        if scheme == "file" and not rest.startswith("/"):
            raise CatalogError(f"adapter source {uri!r}: a local template must be an absolute path")

    @property
    def root(self) -> str:
        """A local template's fixed directory (what its locations are confined to)."""
        return self.path[:self.path.index("{")].rpartition("/")[0] or "/"

    def fill(self, adapter_id: str) -> str:
        """The location (URI without scheme) of `adapter_id` in this source."""
        tenant, name = validate_adapter_id(adapter_id).split("/")
        return self.path.replace("{tenant}", tenant).replace("{name}", name)

    def match(self, uri: str) -> str | None:
        """The adapter id whose location `uri` is in this source, or None."""
        scheme, sep, rest = uri.partition("://")
        if not sep:
            scheme, rest = "file", uri
        found = self._pattern.fullmatch(rest) if scheme == self.scheme else None
        if found is None:
            return None
        try:
            return validate_adapter_id(f"{found['tenant']}/{found['name']}")
        except InvalidAdapterId:  # "." or ".." as a part
            return None


def make_fetcher(template: Template, timeout_s: float) -> Fetcher:
    """The fetcher of `template`'s scheme (boto3 / huggingface_hub imported only when used)."""
    if template.scheme == "file":
        return LocalFetcher(template.root)
    from . import fetchers
    if template.scheme == "s3":
        return fetchers.S3Fetcher(timeout_s)
    return fetchers.HubFetcher(timeout_s)


class LocalFetcher:
    """A local directory template: the adapter dir is read in place, confined to the root."""

    def __init__(self, root: str) -> None:
        self.root = root

    def open(self, location: str, workdir: Path, max_bytes: int) -> AdapterSource:
        return AdapterSource(Path(location).relative_to(self.root), root=self.root, max_bytes=max_bytes)


class SingleFlight:
    """`run(key, fn)`: `fn()` once for concurrent callers with one key; they share its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Future] = {}
        self.started = 0

    def run(self, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = Future()
                self.started += 1
        if not leader:
            return flight.result()
        try:
            result = fn()
            flight.set_result(result)
            return result
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._flights[key]


class AdapterSources:
    """The configured sources, in order, with single flight and a short memory of misses."""

    def __init__(self, templates: list[str], *, max_bytes: int, timeout_s: float = 10.0,
                 negative_ttl_s: float = 5.0, fetchers: dict[str, Fetcher] | None = None) -> None:
        self.templates = [Template(t) for t in templates]
        if not self.templates:
            raise CatalogError("no adapter sources given")
        self.max_bytes = max_bytes
        self.negative_ttl_s = negative_ttl_s
        made = fetchers or {}
        self._fetchers = [made.get(t.uri) or make_fetcher(t, timeout_s) for t in self.templates]
        self._flights = SingleFlight()
        self._missing: BoundedLRU[str, float] = BoundedLRU(4096)  # id -> when every source missed it

    @property
    def fetches(self) -> int:
        """Fetches begun (a flight joined is not one)."""
        return self._flights.started

    def template_of(self, uri: str, adapter_id: str) -> int:
        """Index of the first template `uri` is `adapter_id`'s location in; SourceForbidden (403)
        when none is (a URI outside the sources, or naming another id than the one loaded)."""
        for i, t in enumerate(self.templates):
            if t.match(uri) == adapter_id:
                return i
        raise SourceForbidden(f"{uri!r} is not {adapter_id}'s location in any configured adapter "
                              f"source ({', '.join(t.uri for t in self.templates)})")

    def fetch(self, adapter_id: str, into: Callable[[AdapterSource, str], T], only: int | None = None) -> T:
        """`into(peft_dir, uri)` on the first source (or source `only`) holding `adapter_id`.
        Blocking; single flight per id (module doc)."""
        validate_adapter_id(adapter_id)
        missed = self._missing.get(adapter_id)
        if only is None and missed is not None and time.monotonic() - missed < self.negative_ttl_s:
            raise SourceNotFound(f"adapter {adapter_id!r} is in no adapter source")
        return self._flights.run(f"{adapter_id}#{only}", lambda: self._fetch(adapter_id, into, only))

    def _fetch(self, adapter_id: str, into: Callable[[AdapterSource, str], T], only: int | None) -> T:
        down: list[str] = []
        order = range(len(self.templates)) if only is None else [only]
        for i in order:
            template, fetcher = self.templates[i], self._fetchers[i]
            uri = f"{template.scheme}://{template.fill(adapter_id)}"
            with tempfile.TemporaryDirectory(prefix="loraserve-fetch-") as workdir:
                try:
                    peft_dir = fetcher.open(template.fill(adapter_id), Path(workdir), self.max_bytes)
                except SourceNotFound:
                    continue
                except SourceUnavailable as exc:
                    down.append(str(exc))
                    continue
                return into(peft_dir, uri)
        if down:
            raise SourceUnavailable(f"adapter {adapter_id!r}: no source had it, and "
                                    f"{len(down)} could not be asked: {'; '.join(down)}")
        if only is None:
            self._missing.put(adapter_id, time.monotonic())
        raise SourceNotFound(f"adapter {adapter_id!r} is in no adapter source")


def content_revision(blob: bytes) -> str:
    """The revision id of an import made while the durable tier was down (`importer`'s
    `by_content`): named after its bytes, so it can never be taken for a revision of the store
    holding other bytes (store_s3 `_settle`)."""
    return "src-" + blob_checksum(blob)[:16]


def importer(catalog: Catalog, adapter_id: str, model_dir: str | Path, base: BaseInfo,
             admit: Admit | None = None, *, by_content: bool = False) -> Callable[[AdapterSource, str], RevisionRecord]:
    """The `into` of `AdapterSources.fetch` that imports the fetched directory as a new, promoted
    revision of `adapter_id` (checked against `base`, then `admit`), its record's source the URI;
    the same files fetched again are the promoted revision, not a new one. `by_content`: the
    revision id is `content_revision` of its bytes rather than the next `r{n}`."""
    def into(peft_dir: AdapterSource, uri: str) -> RevisionRecord:
        return import_peft(catalog, adapter_id, peft_dir, model_dir, content_revision if by_content else None,
                           promote=True, base=base, admit=admit, source=uri, keep_promoted=True)
    return into
