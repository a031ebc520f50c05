"""Download a PEFT adapter directory from an S3-compatible bucket or the Hugging Face Hub, verified.

Both fetch the two files a LoRA adapter is served from (`adapter_config.json`,
`adapter_model.safetensors`) into a scratch directory, each bounded before it is read (the
object's stated size against what is left of `max_bytes`), and checked against the checksum the
store states for it:

- S3 (boto3; endpoint, region and credentials from the standard AWS environment and config:
  `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `~/.aws/config`, ...): the
  ETag, which is the MD5 of the bytes for an object uploaded in one part (a multipart ETag,
  `<md5>-<parts>`, is not a checksum of the bytes and is not checked); and our own xxh3-128 when
  the uploader set it as object metadata `xxh3-128` (`x-amz-meta-xxh3-128`). boto3 checks a
  flexible checksum (`x-amz-checksum-*`) itself when the object has one.
- Hub (huggingface_hub's session and headers, honouring `HF_ENDPOINT`, `HF_TOKEN` and
  `HF_HUB_OFFLINE`, which reads its cache `HF_HOME` / `HF_HUB_CACHE`): the file's ETag, which
  is the SHA-256 of an LFS file or the git blob SHA-1 of a regular one; the cache names each
  blob by it, so a cached file is checked too. Online, files are streamed, never past the cap.

A mismatch is an ExportError (400) naming the file and both digests; nothing is imported. A
missing adapter (no `adapter_config.json`) is SourceNotFound (404); a store that cannot be
reached, times out, resets, answers 5xx/403, sends what its protocol does not allow or more
bytes than it stated is SourceUnavailable (503), whatever its client library raised. The
weights file missing is left to the PEFT reader, whose 400 says what it found instead.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import xxhash

from .errors import ExportError, SourceNotFound, SourceTooLarge, SourceUnavailable
from .peft_reader import CONFIG, WEIGHTS
from .source import AdapterSource

XXH3_META = "xxh3-128"  # S3 user metadata key of our own checksum
_MD5 = re.compile(r"[0-9a-f]{32}")


def _mismatch(what: str, kind: str, stated: str, actual: str) -> ExportError:
    return ExportError(f"{what}: {kind} checksum mismatch (the store states {stated}, the bytes "
                       f"hash to {actual}); not imported")


def _budget(what: str, size: int | None, left: int, max_bytes: int) -> None:
    if size is not None and size > left:
        raise SourceTooLarge(f"{what}: {size} bytes; the adapter's files may take {max_bytes} in all")


class S3Fetcher:
    """`bucket/key-prefix` locations of one S3-compatible store (module doc)."""

    def __init__(self, timeout_s: float) -> None:
        import boto3
        from botocore.config import Config
        # bounded: a store that is down answers within ~2 x timeout_s, as a 503
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"max_attempts": 2, "mode": "standard"})
        self.client = boto3.session.Session().client("s3", config=config)

    def open(self, location: str, workdir: Path, max_bytes: int) -> AdapterSource:
        bucket, _, prefix = location.partition("/")
        used = 0
        for name in (CONFIG, WEIGHTS):
            try:
                data = self.get(bucket, f"{prefix}/{name}", max_bytes - used, max_bytes)
            except SourceNotFound:
                if name == CONFIG:
                    raise
                continue  # the reader names what is missing
            (workdir / name).write_bytes(data)
            used += len(data)
        return AdapterSource(workdir, root=workdir, max_bytes=max_bytes)

    def get(self, bucket: str, key: str, left: int, max_bytes: int) -> bytes:
        """The verified bytes of one object, at most `left` of them."""
        from botocore.exceptions import BotoCoreError, ClientError
        what = f"s3://{bucket}/{key}"
        try:
            head = self.client.head_object(Bucket=bucket, Key=key)
            stated = head["ContentLength"]
            _budget(what, stated, left, max_bytes)
            obj = self.client.get_object(Bucket=bucket, Key=key, IfMatch=head["ETag"])
            data = obj["Body"].read(stated + 1)  # never more than it stated, and one byte
        except ClientError as exc:
            raise s3_error(exc, what) from None
        except BotoCoreError as exc:
            raise SourceUnavailable(f"{what}: store unreachable ({exc})") from None
        if len(data) != stated:  # a store that lies about a size is failing, not answering
            raise SourceUnavailable(f"{what}: {len(data)}{'+' if len(data) > stated else ''} "
                                    f"bytes where {stated} were stated")
        verify_s3(what, data, obj["ETag"], obj.get("Metadata", {}))
        return data


def s3_error(exc, what: str) -> Exception:
    """A botocore ClientError as ours: no such key -> 404, anything else -> 503."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    if code in ("404", "NoSuchKey", "NotFound"):
        return SourceNotFound(f"{what} does not exist")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return SourceUnavailable(f"{what}: the store answered {status} {code} {error.get('Message', '')}".rstrip())


def verify_s3(what: str, data: bytes, etag: str, metadata: dict) -> None:
    """The ETag (single-part MD5) and our `xxh3-128` metadata, when stated, match `data`."""
    etag = etag.strip('"')
    if _MD5.fullmatch(etag) and (md5 := hashlib.md5(data).hexdigest()) != etag:
        raise _mismatch(what, "ETag (MD5)", etag, md5)
    stated = metadata.get(XXH3_META)
    if stated is not None and (ours := xxhash.xxh3_128_hexdigest(data)) != stated:
        raise _mismatch(what, "xxh3-128", stated, ours)


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the Hub's ETag of a non-LFS file) gives `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify_hub(what: str, data: bytes, etag: str) -> None:
    """`etag` (the cache's blob name) is `data`'s SHA-256 (LFS) or git blob SHA-1."""
    if len(etag) == 64:
        actual, kind = hashlib.sha256(data).hexdigest(), "SHA-256"
    elif len(etag) == 40:
        actual, kind = git_blob_sha1(data), "git SHA-1"
    else:
        raise ExportError(f"{what}: the Hub stated no checksum (ETag {etag!r}); not imported")
    if actual != etag:
        raise _mismatch(what, kind, etag, actual)


class HubFetcher:
    """`owner/repo` locations on the Hub at `HF_ENDPOINT` (module doc); revision `main`.

    Online, each file is streamed into memory by huggingface_hub's own HTTP session (its
    headers and token): the stated size is checked against the budget first, and the transfer
    stops at the first byte past it (a Hub that lies about a size never gets more than the cap
    written), or past `deadline_s` in all (one byte every few seconds never outlasts it).
    Offline (`HF_HUB_OFFLINE`), files come from huggingface_hub's cache (filled by
    `huggingface-cli download` or `hf_hub_download`), checked against their blob names."""

    def __init__(self, timeout_s: float, revision: str = "main", cache_dir: str | None = None,
                 deadline_s: float = 60.0) -> None:
        self.endpoint = os.environ.get("HF_ENDPOINT") or None  # None: huggingface_hub's default
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.revision = revision
        self.cache_dir = cache_dir  # None: huggingface_hub's (HF_HUB_CACHE, HF_HOME)

    def open(self, location: str, workdir: Path, max_bytes: int) -> AdapterSource:
        used = 0
        for name in (CONFIG, WEIGHTS):
            try:
                data = self.get(location, name, max_bytes - used, max_bytes)
            except SourceNotFound:
                if name == CONFIG:
                    raise
                continue
            (workdir / name).write_bytes(data)
            used += len(data)
        return AdapterSource(workdir, root=workdir, max_bytes=max_bytes)

    def get(self, repo_id: str, name: str, left: int, max_bytes: int) -> bytes:
        from huggingface_hub import constants
        from huggingface_hub import errors as hf
        what = f"hf://{repo_id}/{name}"
        if constants.HF_HUB_OFFLINE:
            return self._cached(repo_id, name, what, left, max_bytes)
        try:
            etag, data = self._download(repo_id, name, what, left, max_bytes)
        except (hf.RepositoryNotFoundError, hf.RevisionNotFoundError, hf.EntryNotFoundError):
            raise SourceNotFound(f"{what} does not exist") from None
        except (SourceNotFound, SourceTooLarge, SourceUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - unreachable, reset, refused, garbage: all one
            raise SourceUnavailable(f"{what}: {type(exc).__name__}: {exc}") from None
        verify_hub(what, data, etag)
        return data

    def _download(self, repo_id: str, name: str, what: str, left: int, max_bytes: int) -> tuple[str, bytes]:
        """(ETag, bytes) of one file: its metadata, then its bytes, bounded (class doc)."""
        import time

        from huggingface_hub import get_hf_file_metadata, get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers
        started = time.monotonic()
        url = hf_hub_url(repo_id, name, revision=self.revision, endpoint=self.endpoint)
        meta = get_hf_file_metadata(url, timeout=self.timeout_s)
        if meta.etag is None or meta.size is None:
            raise SourceUnavailable(f"{what}: the Hub stated no ETag or size")
        _budget(what, meta.size, left, max_bytes)
        data = bytearray()
        with get_session().stream("GET", meta.location or url, headers=build_hf_headers(),
                                  timeout=self.timeout_s, follow_redirects=True) as response:
            if response.status_code == 404:
                raise SourceNotFound(f"{what} does not exist")
            if response.status_code >= 400:
                raise SourceUnavailable(f"{what}: the Hub answered {response.status_code}")
            for chunk in response.iter_bytes():  # each read as it arrives: a drip meets the deadline
                data += chunk
                if len(data) > meta.size:
                    raise SourceUnavailable(f"{what}: the Hub sent more than the {meta.size} "
                                            "bytes it stated; stopped")
                if time.monotonic() - started > self.deadline_s:
                    raise SourceUnavailable(f"{what}: not done within {self.deadline_s:g} s")
        if len(data) != meta.size:
            raise SourceUnavailable(f"{what}: {len(data)} bytes of the {meta.size} stated")
        return meta.etag, bytes(data)

    def _cached(self, repo_id: str, name: str, what: str, left: int, max_bytes: int) -> bytes:
        """Offline: the file from huggingface_hub's cache, checked against its blob name."""
        from huggingface_hub import try_to_load_from_cache
        path = try_to_load_from_cache(repo_id, name, cache_dir=self.cache_dir, revision=self.revision)
        if not isinstance(path, str):
            raise SourceUnavailable(f"{what}: the Hub is offline (HF_HUB_OFFLINE) and the file is not cached")
        blob = os.path.realpath(path)
        _budget(what, os.path.getsize(blob), left, max_bytes)
        with open(blob, "rb") as f:
            data = f.read(left + 1)
        _budget(what, len(data), left, max_bytes)
        verify_hub(what, data, os.path.basename(blob))
        return data
