"""The one answer to a name that names nothing, for every route that looks a model up by name.

What a name stands for (a recorded alias, `tinker://tenant/name[@rev]`, `tinker://<base>`, a
name without a tenant) is decided by the one resolver, `engine.directory.AdapterDirectory`.

Not found (`not_found`): every route that looks a model or adapter up by name (generation on
/v1, /oai/api/v1 and the Tinker routes, /v1/models/{id}, /v1/adapters/{id}, unload, promote,
rollback) answers a name that names nothing the caller's key may see with the same 404: status,
code, param and message, the message echoing the name exactly as the request gave it. An id that
does not exist, an alias nobody recorded, another tenant's adapter, revision or alias: nothing
in the answer tells them apart, nor names what an alias resolved to. (A revision or tag that
does not exist of an adapter the key may see is still `revision_not_found`: the key may know
that adapter exists.)
"""
from __future__ import annotations

from loraserve.catalog.errors import AdapterNotFound
from loraserve.server.errors import APIError, clip

# the codes of the 404s that say a model or adapter does not exist (as_api_error's, the engine's)
NOT_FOUND_CODES = frozenset({"model_not_found", "adapter_not_found"})


def not_found(requested: str) -> APIError:
    """The 404 of a name that names nothing the caller may see (module doc), `requested` being
    the name as the request gave it."""
    return APIError(404, f"The model `{clip(requested)}` does not exist.", code="model_not_found",
                    param="model")


def is_not_found(exc: BaseException) -> bool:
    """Whether `exc` says that a model or adapter does not exist (the catalog's AdapterNotFound,
    the engine's 404 without a catalog, `not_found` itself)."""
    if isinstance(exc, AdapterNotFound):
        return True
    return getattr(exc, "status", None) == 404 and getattr(exc, "code", None) in NOT_FOUND_CODES


def lookup_error(exc: BaseException, requested: str) -> BaseException:
    """`exc` as the answer to a lookup of `requested`: `not_found(requested)` when it says the
    model does not exist, else `exc` itself."""
    return not_found(requested) if is_not_found(exc) else exc
