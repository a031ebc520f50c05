"""Put trained adapters into a catalog: a PEFT directory, or a blob made by `loraserve export`."""
from __future__ import annotations

from pathlib import Path

from .base import BaseInfo
from .errors import BaseMismatch, ExportError
from .export import export_peft
from .ids import validate_adapter_id
from .layout import load_revision, save_revision
from .records import RevisionRecord
from .store import Catalog


def check_base(blob_fingerprint: str, base: BaseInfo, what: str) -> None:
    """BaseMismatch naming both fingerprints unless the blob was built for `base`."""
    if blob_fingerprint != base.fingerprint:
        raise BaseMismatch(
            f"{what} was exported for base {blob_fingerprint}, but {base.model_dir} has fingerprint {base.fingerprint}"
        )


def adapter_blob(source: str | Path, base: BaseInfo, dtype: str | None = None) -> bytes:
    """Serving blob for `source`: a PEFT dir is exported; an exported `.safetensors` file is checked as is."""
    source = Path(source)
    if source.is_dir():
        return save_revision(export_peft(source, base, dtype=dtype))
    if source.is_file():
        blob = source.read_bytes()
        weights = load_revision(blob)
        check_base(weights.base_fingerprint, base, str(source))
        for name, t in weights.tensors.items():
            path = name.rpartition(".")[0]
            if path not in base.modules:
                raise ExportError(f"{source}: {name} targets {path!r}, which the base does not have")
        return blob
    raise ExportError(f"{source}: no such PEFT directory or adapter file")


def import_peft(
    catalog: Catalog, adapter_id: str, peft_dir: str | Path, model_dir: str | Path,
    revision: str | None = None, promote: bool = True, *, base: BaseInfo | None = None, dtype: str | None = None,
) -> RevisionRecord:
    """Export `peft_dir` against the base in `model_dir` and store it as a new revision of `adapter_id`."""
    validate_adapter_id(adapter_id)
    base = base or BaseInfo.from_dir(model_dir)
    blob = adapter_blob(peft_dir, base, dtype)
    return catalog.put_revision(adapter_id, blob, revision=revision, promote=promote, source=f"peft:{Path(peft_dir).name}")
