"""Catalog errors. Each class carries `.status`, the HTTP status the server maps it to.

The server turns any `CatalogError` into an OpenAI-style error body with this status and
`.code` (None: the snake_case of the class name); 500 is reserved for corruption and bugs,
never for bad user input, and 503 for a shard whose files are damaged or gone.
"""
from __future__ import annotations


class CatalogError(Exception):
    """Base of every catalog error; a bare one is an internal or storage failure."""

    status = 500
    code: str | None = None


class AdapterNotFound(CatalogError):
    """No policy record for this adapter id."""

    status = 404


class RevisionNotFound(CatalogError):
    """The adapter exists but has no such revision or tag (or nothing is promoted)."""

    status = 404


class InvalidAdapterId(CatalogError):
    """An adapter id, model reference, revision or tag breaks the naming rules."""

    status = 400


class RevisionExists(CatalogError):
    """An immutable revision id is already taken by different bytes."""

    status = 409


class CorruptBlob(CatalogError):
    """A stored blob fails its checksum, is truncated, or is not a valid adapter blob."""

    status = 500


class BaseMismatch(CatalogError):
    """An adapter revision was built for a different base; the message names both fingerprints."""

    status = 409


class ExportError(CatalogError):
    """A PEFT adapter cannot be turned into the serving layout; the message names the tensor/target."""

    status = 400


class NonFiniteWeights(ExportError):
    """An adapter tensor holds NaN or Inf (as given, or after scaling); the message names the tensor."""


class FactorsTooLarge(ExportError):
    """An adapter's LoRA factors can scale an activation past what its dtype holds (`bounds`):
    finite, yet able to overflow; the message names the target and the bound."""


class SourceForbidden(CatalogError):
    """An adapter file resolves outside the allowed root (the message never says whether it exists)."""

    status = 403


class SourceNotFound(CatalogError):
    """The adapter directory to import does not exist (inside the allowed root)."""

    status = 404


class SourceTooLarge(CatalogError):
    """The adapter files to import exceed the size cap."""

    status = 413


class SourceUnavailable(CatalogError):
    """An adapter source (an object store, the Hub; catalog.sources) cannot be reached, times out
    or refuses us; other sources and the local catalog keep serving."""

    status = 503
    code = "source_unavailable"
    retry_after = 5  # seconds: the server's Retry-After


class ShardUnavailable(CatalogError):
    """A shard's files are missing or damaged (truncated, replaced, removed); other shards keep serving.

    `shards` lists the unavailable shard indices. Not sticky: the shard is checked again on
    every use, so it serves again once its files are restored.
    """

    status = 503
    code = "catalog_unavailable"

    def __init__(self, message: str, shards: list[int] | None = None) -> None:
        super().__init__(message)
        self.shards = list(shards or [])
