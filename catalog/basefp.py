"""`base_fingerprint(model_dir)`, under the name docs/INTERNALS.md §3 uses (lives in catalog.base)."""
from .base import base_fingerprint

__all__ = ["base_fingerprint"]
