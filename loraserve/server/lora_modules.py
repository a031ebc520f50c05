"""`serve --lora-modules`: vLLM's way of naming the adapters a server starts with.

    --lora-modules sql-lora=/path/to/peft [name=path ...]
    --lora-modules '{"name": "sql-lora", "path": "/path/to/peft", "base_model_name": "qwen3"}'

Each PEFT directory is imported into the catalog at start-up, before the engine opens it, as a
promoted revision of `name`; a name without a tenant (vLLM's names have none) belongs to the
default tenant (`catalog.ids.DEFAULT_TENANT`: `sql-lora` is `default/sql-lora`), and requests
name it as `sql-lora` or `default/sql-lora`. Importing equal bytes again makes no new revision,
so restarting with the same flags changes nothing (a changed directory is a new revision). `base_model_name`, when given, must be the
served base's name: the catalog checks every import against the base it is exported for.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from loraserve.catalog.errors import InvalidAdapterId
from loraserve.catalog.ids import validate_adapter_id, with_default_tenant


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry: the adapter id it is served as and its PEFT directory."""

    adapter_id: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """argparse type of `--lora-modules`: `name=path` or vLLM's JSON object."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(
                'expected {"name": ..., "path": ..., "base_model_name": ...}'
                + (f"; unknown keys {unknown}" if unknown else ""))
        name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
        base = None
    try:
        adapter_id = validate_adapter_id(with_default_tenant(name))
    except InvalidAdapterId as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return LoraModule(adapter_id, path, base)


def import_lora_modules(modules: list[LoraModule], catalog_dir: str | None, model_dir: str,
                        served_name: str) -> list[str]:
    """Import each module into the catalog at `catalog_dir` (promoted); returns the refs served.
    ValueError (one line, stopping `serve`) for a server without a catalog, a module made for
    another base, or a directory that does not export (the catalog's own errors)."""
    if not modules:
        return []
    if catalog_dir is None:
        raise ValueError("--lora-modules needs a catalog to import into (--catalog DIR; "
                         "`loraserve catalog init DIR` makes one)")
    from loraserve.catalog.store import Catalog

    for m in modules:
        if m.base_model_name is not None and m.base_model_name != served_name:
            raise ValueError(f"--lora-modules {m.adapter_id}: base_model_name "
                             f"{m.base_model_name!r} is not the served base {served_name!r}")
        if not Path(m.path).is_dir():
            raise ValueError(f"--lora-modules {m.adapter_id}: {m.path} is not a directory")
    with Catalog.open(catalog_dir) as cat:
        return [_import(cat, m, model_dir).ref for m in modules]


def _import(cat, m: LoraModule, model_dir: str):
    """Import `m` as a promoted revision; the promoted one itself when it holds the same bytes
    (the catalog's rule for a revision id given twice), so a restart adds no revision."""
    from loraserve.catalog.errors import AdapterNotFound, RevisionExists
    from loraserve.catalog.importer import import_peft

    source = f"lora-modules:{Path(m.path).name}"
    try:
        promoted = cat.policy(m.adapter_id).promoted
    except AdapterNotFound:
        promoted = None
    if promoted is not None:
        try:
            return import_peft(cat, m.adapter_id, m.path, model_dir, revision=promoted,
                               promote=True, source=source)
        except RevisionExists:
            pass  # the directory changed since: a new revision
    return import_peft(cat, m.adapter_id, m.path, model_dir, promote=True, source=source)
