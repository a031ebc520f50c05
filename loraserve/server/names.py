"""Names of a model as a request gives them, and the one answer to a name that names nothing.

- A name recorded as a catalog alias (`loraserve catalog import ... --alias URI`, e.g. the
  `tinker://<run-id>/sampler_weights/<checkpoint>` MinT exported) is the revision it names.
- `tinker://tenant/name[@rev]` is `tenant/name[@rev]`, and `tinker://<base>` the base model.
- Any other name is itself.

Only names with `://` are looked up (one LMDB read, in the shard the alias hashes to), so an
ordinary model name costs nothing.

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

from typing import Any

from loraserve.catalog.aliases import is_alias, lookup_alias
from loraserve.catalog.errors import AdapterNotFound
from loraserve.server.errors import APIError, clip

TINKER_SCHEME = "tinker://"
# the codes of the 404s that say a model or adapter does not exist (as_api_error's, the engine's)
NOT_FOUND_CODES = frozenset({"model_not_found", "adapter_not_found"})


def canonical_model(model: str, engine: Any) -> str:
    """The loraserve name (`tenant/name[@rev]` or the base's name) that `model` stands for."""
    if not is_alias(model):
        return model
    mgr = engine.adapter_manager
    if mgr is not None and (ref := lookup_alias(mgr.catalog, model)) is not None:
        return ref
    return model.removeprefix(TINKER_SCHEME)


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
