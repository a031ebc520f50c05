"""Put trained adapters into a catalog: a PEFT directory, or a blob made by `loraserve export`.

Everything is checked before anything is written: the export (shapes against the base, finite
values, factors that cannot overflow the serving dtype: `bounds`), then the caller's
`admit(rank, targets)` (e.g. the serving pool's limits), and only then one catalog transaction. A refused import leaves the catalog as it was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .base import BaseInfo
from .bounds import check_servable
from .dtypes import dtype_name
from .errors import AdapterNotFound, BaseMismatch, ExportError, RevisionNotFound
from .export import check_finite, export_peft
from .format import blob_checksum, read_adapter_meta
from .ids import validate_adapter_id
from .layout import load_revision, save_revision
from .records import RevisionRecord
from .source import AdapterSource
from .store import Catalog

Admit = Callable[[int, list[str]], None]  # (rank, targets); raises to refuse


def check_base(blob_fingerprint: str, base: BaseInfo, what: str) -> None:
    """BaseMismatch naming both fingerprints unless the blob was built for `base`."""
    if blob_fingerprint != base.fingerprint:
        raise BaseMismatch(
            f"{what} was exported for base {blob_fingerprint}, but {base.model_dir} has fingerprint {base.fingerprint}"
        )


def adapter_blob(source: str | Path | AdapterSource, base: BaseInfo, dtype: str | None = None,
                 label: str = "") -> bytes:
    """Serving blob for `source`: a PEFT dir (or AdapterSource) is exported (`label`: the
    provenance its header keeps, default `peft:<dir name>`); an exported `.safetensors` file is
    checked as is (base, targets, finite values)."""
    if isinstance(source, AdapterSource):
        return save_revision(export_peft(source, base, dtype=dtype, source=label))
    source = Path(source)
    if source.is_dir():
        return save_revision(export_peft(source, base, dtype=dtype, source=label))
    if source.is_file():
        blob = source.read_bytes()
        weights = load_revision(blob)
        check_base(weights.base_fingerprint, base, str(source))
        for name, t in weights.tensors.items():
            path = name.rpartition(".")[0]
            if path not in base.modules:
                raise ExportError(f"{source}: {name} targets {path!r}, which the base does not have")
        check_finite(weights.tensors, f" in {source}")
        check_servable(weights.tensors, dtype_name(weights.dtype), what=f" in {source}")
        return blob
    raise ExportError(f"{source}: no such PEFT directory or adapter file")


def promoted_if_equal(catalog: Catalog, adapter_id: str, blob: bytes) -> RevisionRecord | None:
    """`adapter_id`'s promoted revision when it holds exactly `blob`, else None."""
    try:
        record = catalog.resolve(adapter_id)
    except (AdapterNotFound, RevisionNotFound):
        return None
    return record if record.checksum == blob_checksum(blob) else None


def import_peft(
    catalog: Catalog, adapter_id: str, peft_dir: str | Path | AdapterSource, model_dir: str | Path,
    revision: str | Callable[[bytes], str] | None = None, promote: bool = True, *, base: BaseInfo | None = None, dtype: str | None = None,
    admit: Admit | None = None, source: str | None = None, keep_promoted: bool = False,
) -> RevisionRecord:
    """Export `peft_dir` against the base in `model_dir` and store it as a new revision of `adapter_id`.

    `admit(rank, targets)` runs after the export and before the write; if it raises, nothing is written.
    `revision`: an id, or a function naming the revision after the exported blob (None: the
    next `r{n}`). `source`: the provenance the record keeps (default `peft:<dir name>`). `keep_promoted`: when
    the export is byte for byte the promoted revision (the same files imported again), that
    revision is the answer and nothing is written.
    """
    validate_adapter_id(adapter_id)
    base = base or BaseInfo.from_dir(model_dir)
    blob = adapter_blob(peft_dir, base, dtype, label=source or "")
    if admit is not None:
        meta = read_adapter_meta(blob)
        admit(meta["rank"], meta["targets"])
    if keep_promoted and (same := promoted_if_equal(catalog, adapter_id, blob)) is not None:
        return same
    if source is None:
        source = f"peft:{peft_dir.name if isinstance(peft_dir, AdapterSource) else Path(peft_dir).name}"
    if callable(revision):
        revision = revision(blob)
    return catalog.put_revision(adapter_id, blob, revision=revision, promote=promote, source=source)
