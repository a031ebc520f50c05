"""Catalog errors. Each class carries `.status`, the HTTP status the server maps it to.

The server turns any `CatalogError` into an OpenAI-style error body with this status;
500 is reserved for corruption and bugs, never for bad user input.
"""
from __future__ import annotations


class CatalogError(Exception):
    """Base of every catalog error; a bare one is an internal or storage failure."""

    status = 500


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
