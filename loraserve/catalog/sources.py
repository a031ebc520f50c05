"""Adapter sources: where an adapter id the catalog lacks may be fetched from, in order.

A source is a URI template with `{tenant}` and `{name}` (`--adapter-source`, repeatable):

    s3://bucket/adapters/{tenant}/{name}    an S3-compatible bucket (fetchers.S3Fetcher)
    hf://{tenant}/{name}                    a Hugging Face Hub repository (fetchers.HubFetcher)
    /srv/adapters/{tenant}/{name}           a local directory (file:// too), confined to the
                                            requesting tenant's subtree (`/srv/adapters/acme`),
                                            links resolved (`Template.tenant_root`)

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

Containment: each source has its own bulkhead (`Bulkhead`: `workers` threads, a cap of as many
fetches at once, an overall deadline per fetch, `deadline_s`, not per read, and a cooldown
after a missed deadline), so a source that hangs, drips, resets or lies holds its own threads
only, and the next source is tried at once. Every failure of a source is SourceUnavailable and
falls through to the next source.

Errors: no source has it -> SourceNotFound (404); a source failed and none had it ->
SourceUnavailable (503, Retry-After; the message names the source by its place and scheme,
`adapter source 2 (hf)`, never its URI: the details go to the log); a bad adapter ->
ExportError (400) naming why; too large -> 413; a local directory outside the tenant's subtree
-> SourceForbidden (403).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
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
log = logging.getLogger(__name__)
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

    def tenant_root(self, adapter_id: str) -> str:
        """A local template's confinement for `adapter_id`: the filled location up to the end of
        the path component holding `{tenant}` (`/srv/{tenant}/{name}` -> `/srv/acme`). An
        adapter directory must resolve inside it, links followed: one tenant's subtree, never
        another's."""
        head = self.path[:self.path.index("{tenant}")]
        rest = self.path[len(head):]
        component = rest.split("/", 1)[0]
        tenant, name = validate_adapter_id(adapter_id).split("/")
        return head + component.replace("{tenant}", tenant).replace("{name}", name)

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


def make_fetcher(template: Template, timeout_s: float, deadline_s: float = 60.0) -> Fetcher:
    """The fetcher of `template`'s scheme (boto3 / huggingface_hub imported only when used)."""
    if template.scheme == "file":
        return LocalFetcher(template)
    from . import fetchers
    if template.scheme == "s3":
        return fetchers.S3Fetcher(timeout_s)
    return fetchers.HubFetcher(timeout_s, deadline_s=deadline_s)


class LocalFetcher:
    """A local directory template: the adapter dir is read in place, confined to the requesting
    tenant's subtree (`Template.tenant_root`) after every link is resolved. The template's fixed
    root may be a link (the operator's); below it, the path to the tenant's subtree must be
    real directories, so a link cannot make one tenant's subtree another's."""

    def __init__(self, template: Template) -> None:
        self.template = template

    def open(self, location: str, workdir: Path, max_bytes: int) -> AdapterSource:
        adapter_id = self.template.match(location)
        if adapter_id is None:
            raise SourceNotFound("no such adapter in this source")
        tenant_root = self.template.tenant_root(adapter_id)
        fixed = os.path.realpath(self.template.root)
        below = os.path.relpath(tenant_root, self.template.root)
        real = os.path.join(fixed, below)
        if not os.path.isdir(real):
            raise SourceNotFound(f"adapter {adapter_id!r} is not in this source")
        if os.path.realpath(real) != os.path.normpath(real):
            raise SourceForbidden(f"adapter {adapter_id!r}: its tenant's directory is a link; refused")
        return AdapterSource(os.path.relpath(location, tenant_root), root=real, max_bytes=max_bytes)


class SingleFlight:
    """`run(key, fn)`: `fn()` once for concurrent callers with one key; they share its outcome.

    `settled` (optional) says whether the work is already done: asked under the lock when no
    flight of the key runs, so a caller that arrives just after a flight ended (it missed
    before that flight landed, then waited for a thread) does not start the same work again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Future] = {}
        self.started = 0

    def run(self, key: str, fn: Callable[[], T], settled: Callable[[], bool] | None = None) -> T | None:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                if settled is not None and settled():
                    return None
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


class _TimedOut(SourceUnavailable):
    """A source's call past its deadline (its thread still runs)."""


class _Refused(SourceUnavailable):
    """A source not asked: cooling down after a missed deadline, or busy until the deadline."""


class Bulkhead:
    """One source's own worker threads, concurrency cap and breaker, so that a slow or hung
    source holds only its own threads, never another source's nor the caller's for long.

    `call(fn)` runs `fn()` on one of `workers` threads and waits at most `deadline_s` for it in
    all (the overall deadline of a fetch, not of one read; waiting for a free thread counts); a
    source that missed a deadline in the last `cooldown_s` is SourceUnavailable at once, and so
    is one whose threads stay busy until the deadline (the caller falls through to the next
    source). A call past its deadline goes on on its thread until the
    transfer ends (its scratch files are removed then), still holding that thread: so at most
    `workers` threads per source are ever stuck."""

    def __init__(self, name: str, workers: int, deadline_s: float, cooldown_s: float) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.name, self.workers = name, workers
        self.deadline_s, self.cooldown_s = deadline_s, cooldown_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="loraserve-source")
        self._slots = threading.BoundedSemaphore(workers)
        self._down_until = 0.0
        self.refused = 0  # calls answered SourceUnavailable without running (busy or cooling)

    def call(self, fn: Callable[[], T], abandoned: Callable[[], None]) -> T:
        """`fn()` within the deadline (waiting for a free thread counts); past it, `abandoned()`
        runs once `fn` has ended."""
        deadline = time.monotonic() + self.deadline_s
        while not self._slots.acquire(timeout=0.05):
            if self._cooling():
                raise _Refused(f"{self.name} missed its deadline recently; not asked")
            if time.monotonic() > deadline:
                self.refused += 1
                raise _Refused(f"{self.name} is busy ({self.workers} fetches in progress)")
        if self._cooling():
            self._slots.release()
            raise _Refused(f"{self.name} missed its deadline recently; not asked")

        def run() -> T:
            try:
                return fn()
            finally:
                self._slots.release()
        try:
            future = self._pool.submit(run)
        except RuntimeError:  # shut down
            self._slots.release()
            raise SourceUnavailable(f"{self.name} is closed") from None
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._down_until = time.monotonic() + self.cooldown_s
            future.add_done_callback(lambda _: abandoned())
            raise _TimedOut(f"{self.name} did not answer within {self.deadline_s:g} s") from None

    def _cooling(self) -> bool:
        if time.monotonic() < self._down_until:
            self.refused += 1
            return True
        return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AdapterSources:
    """The configured sources, in order, with single flight, a short memory of misses, and a
    bulkhead per source (`Bulkhead`)."""

    def __init__(self, templates: list[str], *, max_bytes: int, timeout_s: float = 10.0,
                 negative_ttl_s: float = 5.0, fetchers: dict[str, Fetcher] | None = None,
                 deadline_s: float = 30.0, workers: int = 2, cooldown_s: float = 5.0) -> None:
        self.templates = [Template(t) for t in templates]
        if not self.templates:
            raise CatalogError("no adapter sources given")
        self.max_bytes = max_bytes
        self.negative_ttl_s = negative_ttl_s
        made = fetchers or {}
        self._fetchers = [made.get(t.uri) or make_fetcher(t, timeout_s, deadline_s) for t in self.templates]
        self.bulkheads = [Bulkhead(source_name(i, t), workers, deadline_s, cooldown_s)
                          for i, t in enumerate(self.templates)]
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
        raise SourceForbidden(f"the URI is not {adapter_id}'s location in any configured adapter source")

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
            template = self.templates[i]
            uri = f"{template.scheme}://{template.fill(adapter_id)}"
            try:
                peft_dir, workdir = self._open(i, adapter_id)
            except SourceNotFound:
                continue
            except SourceUnavailable as exc:
                log.log(logging.DEBUG if isinstance(exc, _Refused) else logging.WARNING,
                        "adapter source %s (%s) failed for %s: %s", i + 1, template.uri, adapter_id, exc)
                down.append(self.bulkheads[i].name)
                continue
            except CatalogError as exc:  # an answer (403, 413, a checksum): named, not located
                raise _without(exc, uri, f"{adapter_id} from {self.bulkheads[i].name}") from None
            try:
                return into(peft_dir, uri)
            except CatalogError as exc:  # the scratch directory is no one's business
                raise _without(exc, workdir, f"{adapter_id} from {self.bulkheads[i].name}") from None
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        if down:
            raise SourceUnavailable(f"adapter {adapter_id!r}: no source had it, and "
                                    f"{len(down)} could not be asked ({', '.join(down)}); retry later")
        if only is None:
            self._missing.put(adapter_id, time.monotonic())
        raise SourceNotFound(f"adapter {adapter_id!r} is in no adapter source")

    def _open(self, i: int, adapter_id: str) -> tuple[AdapterSource, str]:
        """Source i's PEFT directory of `adapter_id` and its scratch directory, through its
        bulkhead: any failure of the source (timeout, reset, refused, garbage it cannot parse,
        a size it lied about) is SourceUnavailable; SourceNotFound, SourceForbidden,
        SourceTooLarge and checksum mismatches (ExportError) are answers, kept as they are."""
        template, fetcher = self.templates[i], self._fetchers[i]
        workdir = tempfile.mkdtemp(prefix="loraserve-fetch-")

        def opened() -> AdapterSource:
            try:
                return fetcher.open(template.fill(adapter_id), Path(workdir), self.max_bytes)
            except CatalogError:
                raise
            except Exception as exc:  # noqa: BLE001 - a source's failure, whatever its library raised
                raise SourceUnavailable(f"{type(exc).__name__}: {exc}") from None

        def remove() -> None:
            shutil.rmtree(workdir, ignore_errors=True)
        try:
            # past the deadline the transfer goes on on the source's thread; its files go after it
            peft_dir = self.bulkheads[i].call(opened, abandoned=remove)
        except _TimedOut:
            raise
        except BaseException:
            remove()
            raise
        return peft_dir, workdir

    def close(self) -> None:
        for bulkhead in self.bulkheads:
            bulkhead.close()


def source_name(i: int, template: Template) -> str:
    """How answers name a source: its place and scheme, never its URI (bucket names, hosts)."""
    return f"adapter source {i + 1} ({template.scheme})"


def _without(exc: CatalogError, workdir: str, label: str) -> CatalogError:
    """`exc` with the scratch directory's path in its message replaced by `label`."""
    text = str(exc)
    if workdir not in text:
        return exc
    clean = type(exc).__new__(type(exc))
    clean.__dict__.update(exc.__dict__)
    clean.args = (text.replace(workdir, label),)
    return clean


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
