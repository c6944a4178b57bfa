"""Checkpoint roots on object stores (``s3://``, ``gs://``, ... through fsspec).

The checkpoint code reads and writes local files (``os.pread``, ``writev``, fsync); an
object store has no rename, no append and no directories. So a remote root is served by
staging:

* **Writing**: a :class:`~checkpoint.writer.CheckpointWriter` on a URL writes each data
  file into a private local staging directory and uploads it when it is closed (one
  object per file), then deletes the local copy. ``commit`` checks the sizes of the
  uploaded objects and PUTs ``manifest.json`` **last**, as one object: an object PUT is
  atomic, so a checkpoint is visible exactly when its manifest is, and a writer that
  dies before that leaves only data objects that no reader ever takes (no manifest: not
  committed) and that retention removes once a newer chain is kept.
* **Reading** (scan, verify, restore, retention, ``load``, ``inspect``): the committed
  checkpoints are mirrored into a local cache (``DEEPREC_CHECKPOINT_CACHE``, default
  ``<tmp>/deeprec-checkpoint-cache/<hash of the URL>``): data objects first, the manifest
  last, each downloaded to a temporary name and renamed, under a file lock (several PS
  of one host share the cache). A committed checkpoint never changes, so a mirrored one
  (same manifest ETag) is not downloaded again. The local reader then verifies and
  applies exactly as for a local root. Checkpoints with no manifest remotely appear as
  empty directories in the mirror: never restorable, and counted for ids and retention.
* **Retention** deletes a checkpoint's manifest object first, then its data objects.

Credentials and endpoint come from the environment as for data files
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``; see
:mod:`deeprec_ext.data.fs`). Errors name the location: a missing bucket, rejected
credentials or an unknown scheme raise :class:`~checkpoint.format.CheckpointError`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from checkpoint.format import DIR_RE, MANIFEST_NAME, CheckpointError
from deeprec_ext.data.fs import filesystem, is_remote

__all__ = ["is_remote", "join", "listing", "mirror", "upload", "put_bytes", "delete",
           "check_root", "exists", "cache_dir", "to_url", "get_manifest"]

_ETAG = ".etag"


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def _fs(url: str):
    try:
        fs, _ = filesystem(url)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint location {exc}") from None
    return fs


def _explain(url: str, exc: BaseException) -> CheckpointError:
    """A storage error as one line naming the location and the likely cause."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    if "nosuchbucket" in low or ("bucket" in low and "not exist" in low):
        why = f"bucket '{bucket}' does not exist"
    elif isinstance(exc, PermissionError) or any(
            s in low for s in ("accessdenied", "access denied", "invalidaccesskeyid",
                               "signaturedoesnotmatch", "forbidden", "403")):
        why = ("access denied: the credentials were rejected (AWS_ACCESS_KEY_ID / "
               "AWS_SECRET_ACCESS_KEY)")
    elif any(s in low for s in ("could not connect", "connect timeout", "endpoint",
                                "connection refused", "name or service not known")):
        why = f"cannot reach the storage endpoint ({text})"
    else:
        why = text
    return CheckpointError(f"checkpoint location {url}: {why}")


def _call(url: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp/OSError: named, one line
        raise _explain(url, exc) from None


def _strip(fs, url: str) -> str:
    return fs._strip_protocol(url).rstrip("/")


def check_root(url: str) -> None:
    """Raise CheckpointError unless ``url`` names a reachable bucket (the root prefix
    itself may be empty: it is created by the first checkpoint)."""
    fs = _fs(url)
    path = _strip(fs, url)
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise CheckpointError(f"checkpoint location {url}: no bucket in the URL")
    fs.invalidate_cache()
    if not _call(url, fs.exists, bucket):
        # exists() says False for a refused key too: a listing tells which it is
        # (NoSuchBucket, or AccessDenied / InvalidAccessKeyId), named by _explain
        _call(url, fs.ls, bucket, detail=False, refresh=True)
        raise CheckpointError(f"checkpoint location {url}: bucket '{bucket}' does not exist "
                              "(or is not visible with these credentials)")


def exists(url: str) -> bool:
    """Whether any object is at or under ``url`` (its bucket checked first)."""
    check_root(url)
    fs = _fs(url)
    return bool(_call(url, fs.exists, _strip(fs, url)))


def listing(url: str) -> dict[str, dict[str, dict]]:
    """``{checkpoint directory name: {file name: info (size, ETag)}}`` under ``url``, from
    one recursive listing (fresh: never a cached one)."""
    fs = _fs(url)
    root = _strip(fs, url)
    check_root(url)
    found = _call(url, fs.find, root, detail=True)
    out: dict[str, dict[str, dict]] = {}
    for path, info in found.items():
        parts = path[len(root):].lstrip("/").split("/")
        if len(parts) == 2 and DIR_RE.match(parts[0]):
            out.setdefault(parts[0], {})[parts[1]] = info
    return out


def cache_dir(url: str) -> Path:
    base = os.environ.get("DEEPREC_CHECKPOINT_CACHE") or os.path.join(
        tempfile.gettempdir(), "deeprec-checkpoint-cache")
    return Path(base) / hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _get(fs, url: str, pairs: list[tuple[str, Path]]) -> None:
    """Download (remote path, local path) pairs: to temporary names, then renamed."""
    if not pairs:
        return
    tmps = [p.with_name(f".{p.name}.part-{os.getpid()}") for _, p in pairs]
    try:
        _call(url, fs.get, [r for r, _ in pairs], [str(t) for t in tmps])
        for t, (_, p) in zip(tmps, pairs):
            os.replace(t, p)
    finally:
        for t in tmps:
            with contextlib.suppress(FileNotFoundError):
                t.unlink()


def _tag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or info.get("md5Hash")
               or info.get("size"))


def mirror(url: str, names=None) -> Path:
    """Bring the committed checkpoints under ``url`` (``names``: only these directories)
    into the local cache; returns the cache's root, a local checkpoint root."""
    fs = _fs(url)
    root = _strip(fs, url)
    local = cache_dir(url)
    with _locked(local):
        remote = listing(url)
        for name, files in sorted(remote.items()):
            d = local / name
            d.mkdir(exist_ok=True)
            if MANIFEST_NAME not in files:  # not committed (being written, or abandoned)
                for p in d.iterdir():
                    if p.is_file():
                        p.unlink()
                continue
            if names is not None and name not in names:
                continue
            tag = _tag(files[MANIFEST_NAME])
            etag = d / _ETAG
            if (d / MANIFEST_NAME).exists() and etag.exists() and etag.read_text() == tag:
                continue
            # the manifest goes last: a mirrored directory is committed once complete
            for p in (d / MANIFEST_NAME, etag):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            for p in d.iterdir():
                if p.is_file() and p.name not in files:
                    p.unlink()
            todo = [(f"{root}/{name}/{f}", d / f) for f, info in files.items()
                    if f != MANIFEST_NAME and not (
                        (d / f).exists() and (d / f).stat().st_size == int(info["size"]))]
            _get(fs, url, todo)
            _get(fs, url, [(f"{root}/{name}/{MANIFEST_NAME}", d / MANIFEST_NAME)])
            etag.write_text(tag)
        for p in local.iterdir():  # deleted remotely (retention elsewhere)
            if p.is_dir() and DIR_RE.match(p.name) and p.name not in remote:
                shutil.rmtree(p, ignore_errors=True)
    return local


def get_manifest(url: str, name: str, local_dir: Path) -> None:
    """Download only the manifest of checkpoint directory ``name`` into ``local_dir``."""
    fs = _fs(url)
    _get(fs, url, [(f"{_strip(fs, url)}/{name}/{MANIFEST_NAME}", Path(local_dir) / MANIFEST_NAME)])


def upload(local: Path, url: str) -> None:
    fs = _fs(url)
    _call(url, fs.put_file, str(local), _strip(fs, url))


def put_bytes(url: str, data: bytes) -> None:
    """One object, one PUT: readers see all of it or nothing."""
    fs = _fs(url)
    _call(url, fs.pipe_file, _strip(fs, url), data)


def delete(url: str, name: str, files=None) -> None:
    """Remove checkpoint directory ``name``: its manifest first (it stops being a
    checkpoint at once), then its data objects."""
    fs = _fs(url)
    base = f"{_strip(fs, url)}/{name}"
    if files is None:
        files = listing(url).get(name, {})
    if MANIFEST_NAME in files:
        _call(url, fs.rm_file, f"{base}/{MANIFEST_NAME}")
    rest = [f"{base}/{f}" for f in files if f != MANIFEST_NAME]
    if rest:
        _call(url, fs.rm, rest)


def to_url(url: str, local_path) -> str:
    """The URL of a path inside the mirror of ``url``."""
    rel = os.path.relpath(str(local_path), str(cache_dir(url)))
    return url.rstrip("/") if rel == "." else join(url, *Path(rel).parts)
