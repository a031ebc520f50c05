"""The files of one adapter directory, read confined to a root, without blocking, and bounded.

`AdapterSource(path, root=..., max_bytes=...)` is how the importer reads a PEFT directory:

- confined: the directory and every file read resolve (symlinks followed) inside `root`, else
  SourceForbidden (403) with one message whether the target exists or not; the resolved path is
  then opened one component at a time with O_NOFOLLOW from the root, so a link swapped in after
  the check is refused, not followed. `root=None` (the command line) confines to `/`.
- never blocking: files are opened O_NONBLOCK and must be regular files (fstat), so a FIFO or a
  device is a 400 at once, never a read that waits for a writer.
- bounded: the bytes read in all stay within `max_bytes`, else SourceTooLarge (413).

A missing directory is SourceNotFound (404); a path that is not a directory, or that no OS path
can spell (a NUL, a lone surrogate), is an ExportError (400).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import CatalogError, ExportError, SourceForbidden, SourceNotFound, SourceTooLarge

# O_PATH (Linux): walking a directory needs search permission only, as a path lookup does
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _os_path(path: str | Path, what: str) -> str:
    """`path` as a string the OS can take; ExportError (400) for a NUL or an unencodable character."""
    text = os.fspath(path)
    if "\0" in text:
        raise ExportError(f"{what} contains a NUL character")
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        raise ExportError(f"{what} is not a valid file name (unencodable character)") from None
    return text


def _inside(path: str, root: str) -> bool:
    return root == os.sep or path == root or path.startswith(root + os.sep)


class AdapterSource:
    """One adapter directory under `root` (see module doc); `shown` names it in messages."""

    def __init__(self, path: str | Path, *, root: str | Path | None = None, max_bytes: int | None = None) -> None:
        self.shown = _os_path(path, "adapter path")
        self.root = os.path.realpath(_os_path(root, "adapter root")) if root is not None else os.sep
        if not os.path.isdir(self.root):  # the server's configuration, not the request, is wrong
            raise CatalogError(f"adapter root {self.root} is not a directory")
        self.max_bytes = max_bytes
        self.used = 0
        # relative to the root; unconfined, relative to the working directory as usual
        joined = os.path.join(self.root, self.shown) if root is not None else os.path.abspath(self.shown)
        self.dir = self._confined(joined, self.shown)
        fd = self._open(self.dir, _DIR_FLAGS, self.shown, is_dir=True)
        os.close(fd)

    @property
    def name(self) -> str:
        return os.path.basename(self.dir)

    def describe(self, name: str) -> str:
        """`name` inside the source as the caller spelled the source (never the resolved path)."""
        return f"{self.shown.rstrip(os.sep) or os.sep}/{name}"

    def _confined(self, path: str, shown: str) -> str:
        real = os.path.realpath(path)
        if not _inside(real, self.root):
            # the same words for a target that exists and one that does not
            raise SourceForbidden(f"{shown!r} is outside the allowed adapter root")
        return real

    def _open(self, real: str, flags: int, shown: str, is_dir: bool = False) -> int:
        """Open resolved path `real` by walking from the root with O_NOFOLLOW at every step."""
        rel = os.path.relpath(real, self.root)
        parts = [] if rel == os.curdir else rel.split(os.sep)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                nfd = os.open(part, flags if last else _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except OSError as e:
            os.close(fd)
            raise self._open_error(e, shown, is_dir) from None
        return fd

    def _open_error(self, e: OSError, shown: str, is_dir: bool) -> Exception:
        if e.errno == errno.ENOENT:
            return SourceNotFound(f"{shown!r} does not exist") if is_dir else FileNotFoundError(shown)
        if e.errno == errno.ELOOP:  # a link swapped in after the check
            return SourceForbidden(f"{shown!r} is outside the allowed adapter root")
        if e.errno == errno.ENOTDIR:
            return ExportError(f"{shown!r} is not a directory" if is_dir else f"{shown!r}: a path component is not a directory")
        return ExportError(f"{shown!r} cannot be opened: {e.strerror}")

    def exists(self, name: str) -> bool:
        """Whether `name` exists in the directory (as anything; a link is not followed)."""
        try:
            os.lstat(os.path.join(self.dir, name))
        except OSError:
            return False
        return True

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of regular file `name`; FileNotFoundError if it is missing (callers word it).

        `limit`: a cap for this file alone (SourceTooLarge). Also counts against `max_bytes`.
        """
        shown = self.describe(name)
        real = self._confined(os.path.join(self.dir, name), shown)
        fd = self._open(real, _FILE_FLAGS, shown)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ExportError(f"{shown}: not a regular file")
            cap = self._cap(limit)
            if cap is not None and st.st_size > cap:
                raise self._too_large(shown, st.st_size, limit)
            data = f.read() if cap is None else f.read(cap + 1)  # +1: a file that grew is caught too
        if cap is not None and len(data) > cap:
            raise self._too_large(shown, len(data), limit)
        self.used += len(data)
        return data

    def _cap(self, limit: int | None) -> int | None:
        caps = [c for c in (limit, None if self.max_bytes is None else self.max_bytes - self.used) if c is not None]
        return min(caps) if caps else None

    def _too_large(self, shown: str, size: int, limit: int | None) -> SourceTooLarge:
        if limit is not None and size > limit:
            return SourceTooLarge(f"{shown}: {size} bytes, more than the {limit} allowed for this file")
        return SourceTooLarge(f"{self.shown!r}: adapter files exceed the {self.max_bytes}-byte import limit")
