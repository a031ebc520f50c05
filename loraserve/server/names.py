"""Other names of a model: catalog aliases and `tinker://` names, as a request may give them.

- A name recorded as a catalog alias (`loraserve catalog import ... --alias URI`, e.g. the
  `tinker://<run-id>/sampler_weights/<checkpoint>` MinT exported) is the revision it names.
- `tinker://tenant/name[@rev]` is `tenant/name[@rev]`, and `tinker://<base>` the base model.
- Any other name is itself.

Only names with `://` are looked up (one LMDB read, in the shard the alias hashes to), so an
ordinary model name costs nothing.
"""
from __future__ import annotations

from typing import Any

from loraserve.catalog.aliases import is_alias, lookup_alias

TINKER_SCHEME = "tinker://"


def canonical_model(model: str, engine: Any) -> str:
    """The loraserve name (`tenant/name[@rev]` or the base's name) that `model` stands for."""
    if not is_alias(model):
        return model
    catalog = getattr(getattr(engine, "adapter_manager", None), "catalog", None)
    if catalog is not None and (ref := lookup_alias(catalog, model)) is not None:
        return ref
    return model.removeprefix(TINKER_SCHEME)
