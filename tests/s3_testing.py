"""A real S3-compatible server for tests: moto's standalone server on 127.0.0.1, started here.

`moto_s3()` starts `ThreadedMotoServer` on a free port and points the standard AWS environment
at it (`AWS_ENDPOINT_URL`, test credentials, a region), so code under test finds it exactly as
it finds a real store: through boto3's own configuration. `stop()` / `start()` take it down and
bring it back on the same port (the buckets survive: moto keeps them in this process).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint)

    def put_dir(self, bucket: str, prefix: str, folder: Path, metadata: dict | None = None) -> None:
        """Upload every file of `folder` under `prefix/` (bucket created when missing)."""
        s3 = self.client()
        if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
            s3.create_bucket(Bucket=bucket)
        for f in sorted(folder.iterdir()):
            extra = {"Metadata": metadata[f.name]} if metadata and f.name in metadata else {}
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes(), **extra)


@contextmanager
def moto_s3() -> Iterator[MotoS3]:
    """A started MotoS3 with the AWS environment pointing at it for the duration."""
    server = MotoS3()
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, AWS_ENDPOINT_URL=server.endpoint)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def blob_object(store, adapter_id: str, revision: str) -> str:
    """The key of the store's object holding `adapter_id@revision`'s blob: the segment its
    publish wrote (the blob alone in it, at offset 0), or `blobs/<checksum>` in a store written
    before segments. A test corrupts the blob by writing that object."""
    record, where = store.locate(store.policy_doc(adapter_id), revision)
    if where is None:
        return store.blob_key(record.checksum)
    assert where["offset"] == 0, "a bulk-published segment holds other blobs too"
    return where["segment"]
