"""One file-system layer for data files: local paths, or any URL fsspec knows.

``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``http(s)://`` ... go through fsspec (its
``s3fs``, ``gcsfs``, ... back ends must be installed; ``s3fs`` is a dependency). A plain
path (or ``file://``) takes the local fast path: ``os.pread`` on a file descriptor.

Credentials and endpoint come from the usual environment variables of each back end; for
S3 ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_DEFAULT_REGION`` and ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``: an
S3-compatible server such as MinIO or Ceph), read when a file system is first used in the
process.

Everything the shard service does to a file is here: ``glob``, ``size``, and
``RangeFile.pread`` (one ranged GET for a remote file; a small read fetches at least
64 KiB and later small reads inside it are served from it; the size is asked only when
a short read has not told it). ``RangeFile.reader()`` gives pyarrow a file object on the
same reads.

The ranged reads of ``s3://`` objects (every shard's bytes: text, TFRecord, Parquet row
groups, gzip streams) go through botocore's synchronous client, not s3fs: the same
library under s3fs (same credentials chain, endpoint, region and addressing; retries
in botocore's ``standard`` mode), without its asyncio layer, which cost this process
about 1.5x the CPU (docs/BENCHMARKS.md). Each is a GET of a presigned URL on the
client's HTTP session, ``get_object`` being the fallback (``_s3_get``): about 1 ms of
CPU a request, as much as 4 MB of data: few, large requests. Listing and sizes stay on
fsspec.
"""
from __future__ import annotations

import io
import os
import threading
import time

_BLOCK = 1 << 20
# small remote reads (the rest of the record that crosses a shard's end) fetch this much:
# a whole block there made every remote text shard of 4 MiB read 18% more than its bytes
_TAIL = 64 << 10
# a gzip stream (one shard per file) is read in requests of this size
_STREAM = 8 << 20
_lock = threading.Lock()
_filesystems: dict = {}
_S3 = ("s3", "s3a")


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _options(protocol: str) -> dict:
    if protocol in _S3:
        endpoint = _endpoint()
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
             "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")


def _s3_client():
    """``(botocore S3 client, endpoint)`` for the current environment: one per endpoint and
    set of AWS_* variables (a changed key or endpoint takes effect). Credentials, region
    and profile come from botocore's usual chain, as for s3fs; retries in botocore's
    ``standard`` mode (3 attempts) unless ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS`` say
    otherwise."""
    endpoint = _endpoint()
    key = ("botocore", endpoint, tuple(os.environ.get(k) for k in _ENV_KEYS))
    with _lock:
        client = _filesystems.get(key)
        if client is None:
            import botocore.config
            import botocore.session
            retries = None if os.environ.get("AWS_RETRY_MODE") or \
                os.environ.get("AWS_MAX_ATTEMPTS") else {"mode": "standard"}
            # a pool per tf.data reading thread, so parallel shards do not wait on a socket;
            # SigV4 for the presigned URLs of ``_s3_get`` (botocore signs requests so anyway)
            config = botocore.config.Config(retries=retries, max_pool_connections=32,
                                            signature_version="s3v4")
            client = botocore.session.get_session().create_client(
                "s3", endpoint_url=endpoint, config=config)
            _filesystems[key] = client
    return client, endpoint


# a presigned URL is signed for this long and used for at most _URL_REUSE of it: less
# than botocore's refresh margin of temporary credentials (10-15 min), so a URL is never
# signed with credentials about to expire
_URL_EXPIRES = 900
_URL_REUSE = 300.0
_URL_MAX = 4096
_urls: dict = {}


def _s3_get(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an ``s3://`` object in one ranged GET (fewer at the end
    of the object; none when ``start`` is at or past it). A missing object, refused
    credentials or an unreachable endpoint is an ``OSError`` naming the URL.

    The GET is a presigned URL (botocore's signer, endpoint, addressing and credentials;
    one per object, kept ``_URL_REUSE`` seconds) sent on the client's own HTTP session
    (its pool, proxies, TLS settings and timeouts): botocore's per-request pipeline (event
    hooks, endpoint rules, user agent, response parsing) cost about 1.5 ms of CPU per
    request, as much as the 6 MB of a Parquet row group (docs/BENCHMARKS.md). Anything
    but a whole 206/200 answer (an error status, a redirect, a cut or short body, no
    connection) is done again through ``client.get_object``, whose retries, region
    redirects and errors are the reference."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    client, endpoint = _s3_client()
    data = _s3_get_presigned(client, endpoint, bucket, key, start, end)
    if data is not None:
        return data
    return _s3_get_object(url, client, endpoint, bucket, key, start, end)


def _s3_get_presigned(client, endpoint, bucket: str, key: str, start: int,
                      end: int) -> bytes | None:
    """``_s3_get``'s fast path; None when it cannot give the whole answer."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if session is None or end <= start:
        return None
    from botocore.awsrequest import AWSRequest
    ukey = (id(client), bucket, key)
    now = time.monotonic()
    resp, whole = None, False
    try:
        hit = _urls.get(ukey)
        if hit is None or hit[1] <= now:
            hit = (client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key},
                ExpiresIn=_URL_EXPIRES), now + _URL_REUSE)
            with _lock:
                if len(_urls) >= _URL_MAX:
                    _urls.clear()
                _urls[ukey] = hit
        # only the host is signed in a presigned URL: the Range header may be added
        req = AWSRequest("GET", hit[0], headers={"Range": f"bytes={start}-{end - 1}"}).prepare()
        req.stream_output = True
        resp = session.send(req)
        if resp.status_code not in (200, 206):
            _urls.pop(ukey, None)  # e.g. rotated keys: signed again next time
            return None
        data = resp.raw.read()
        length = resp.headers.get("content-length")
        if length is None or len(data) != int(length):
            return None  # a cut body: botocore reads it again
        whole = True
        if resp.status_code == 200:  # a server that ignored the range sent the object
            data = data[start:end]
        return data
    except Exception:  # noqa: BLE001 - any failure is retried, and reported, by botocore
        _urls.pop(ukey, None)
        return None
    finally:
        if resp is not None:
            if not whole:  # an unread or cut body: the connection is not reused
                resp.raw.close()
            resp.raw.release_conn()


def _s3_get_object(url: str, client, endpoint, bucket: str, key: str, start: int,
                   end: int) -> bytes:
    """``_s3_get`` through botocore's ``get_object`` (retries, redirects, errors)."""
    from botocore.exceptions import BotoCoreError, ClientError
    try:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        return resp["Body"].read()
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        why = f"{code}: {err.get('Message') or exc}"
        if code == "InvalidRange" or status == 416:  # the range starts at or past the end
            return b""
        if code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404") or status == 404:
            raise FileNotFoundError(f"{url}: no such object ({why})") from None
        if status in (401, 403):
            raise PermissionError(f"{url}: access denied ({why}); check AWS_ACCESS_KEY_ID, "
                                  "AWS_SECRET_ACCESS_KEY (or the profile/role) and the "
                                  "bucket's policy") from None
        raise OSError(f"{url}: S3 refused the read ({why})") from None
    except (BotoCoreError, OSError) as exc:  # endpoint down, timeout, cut transfer
        raise OSError(f"{url}: cannot read from S3 at {endpoint or 'AWS'} "
                      f"({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # urllib3's errors while streaming the body
        if type(exc).__module__.startswith("urllib3"):
            raise OSError(f"{url}: cannot read from S3 at {endpoint or 'AWS'} "
                          f"({type(exc).__name__}: {exc})") from None
        raise


def filesystem(url: str):
    """``(fsspec file system, protocol)`` for a URL; one instance per protocol and
    settings (the environment is read on each call: a changed endpoint takes effect)."""
    import fsspec
    protocol = url.split("://", 1)[0]
    options = _options(protocol)
    key = (protocol, repr(options))
    with _lock:
        fs = _filesystems.get(key)
        if fs is None:
            try:
                fs = fsspec.filesystem(protocol, **options)
            except ImportError as exc:  # the scheme's back end is not installed
                raise ValueError(f"{url}: no file system for {protocol}:// here ({exc})") from None
            _filesystems[key] = fs
    return fs, protocol


def absolute(path: str) -> str:
    """A local path made absolute (workers may run elsewhere); a URL unchanged."""
    return path if is_remote(path) else os.path.abspath(_local(path))


def _url(protocol: str, path: str) -> str:
    return path if "://" in path else f"{protocol}://{path}"


def glob(pattern: str) -> list[str]:
    """Sorted files matching ``pattern`` (a path or URL; a URL without a wildcard that names
    one file matches it). Remote results keep the URL form."""
    if not is_remote(pattern):
        import glob as _glob
        return sorted(_glob.glob(_local(pattern)))
    fs, protocol = filesystem(pattern)
    fs.invalidate_cache()  # a watched prefix must be listed anew every time
    if any(c in pattern for c in "*?["):
        found = fs.glob(pattern, detail=True)
    else:
        found = {pattern: fs.info(pattern)} if fs.exists(pattern) else {}
    return sorted(_url(protocol, p) for p, info in found.items() if info.get("type") != "directory")


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(_local(path))
    fs, _ = filesystem(path)
    return int(fs.size(path))


def open_binary(path: str, sequential: bool = True):
    """A binary, seekable file object: for a reader going through the file (gzip:
    ``sequential``, with read-ahead) or one reading the ranges it needs (Parquet column
    chunks: no read-ahead, which fetched up to 4 MiB past every chunk, 36% more than the
    shards' bytes)."""
    if not is_remote(path):
        return open(_local(path), "rb")
    if sequential and path.split("://", 1)[0] in _S3:
        # ranged GETs of 8 MiB through the S3 client of ``RangeFile``
        return io.BufferedReader(RangeFile(path).reader(), _STREAM)
    fs, _ = filesystem(path)
    if not sequential:
        return fs.open(path, "rb", block_size=_BLOCK, cache_type="none")
    return fs.open(path, "rb", block_size=4 * _BLOCK, cache_type="readahead")


class RangeFile:
    """``pread(n, pos)`` on a local or remote file. A remote file's ``size`` is asked for
    (one HEAD) only when needed: a ranged read shorter than asked ends at the end of the
    file, so a shard read with its tail in one request needs no other request."""

    def __init__(self, path: str, size_hint: int | None = None):
        self.path = path
        self._remote = is_remote(path)
        self._block = (-1, b"")
        if self._remote:
            self._fs, protocol = filesystem(path)
            self._s3 = protocol in _S3
            self._size = int(size_hint) if size_hint else None
            self._fd = None
        else:
            self._fd = os.open(_local(path), os.O_RDONLY)
            self._size = os.fstat(self._fd).st_size if size_hint is None else int(size_hint)

    @property
    def remote(self) -> bool:
        return self._remote

    @property
    def size(self) -> int:
        if self._size is None:
            try:
                self._size = int(self._fs.size(self.path))
            except FileNotFoundError:  # fsspec names the key without its scheme
                raise FileNotFoundError(f"{self.path}: no such object") from None
            except OSError as exc:
                raise OSError(f"{self.path}: cannot stat ({type(exc).__name__}: {exc})") \
                    from None
        return self._size

    def at_eof(self, pos: int) -> bool:
        """Whether ``pos`` is known to be at or past the end (a remote file whose size is
        not known yet: False)."""
        return self._size is not None and pos >= self._size

    def pread(self, n: int, pos: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (fewer only at the end of the file)."""
        if n <= 0 or (self._size is not None and pos >= self._size):
            return b""
        if self._size is not None:
            # a range "to the end" ends far past it (1 << 40): pread would allocate that
            n = min(n, self._size - pos)
        if not self._remote:
            return os.pread(self._fd, n, pos)
        start, data = self._block
        if start <= pos and pos + n <= start + len(data):
            return data[pos - start:pos - start + n]
        want = n if n >= _BLOCK else max(n, _TAIL)
        data = self._get(pos, want)
        if n < _BLOCK:
            self._block = (pos, data)
        return data[:n]

    def _get(self, pos: int, n: int) -> bytes:
        end = pos + n if self._size is None else min(pos + n, self._size)
        if self._s3:  # a range starting at the end reads nothing, no error
            data = _s3_get(self.path, pos, end)
            if len(data) < end - pos:
                self._size = pos + len(data)
            return data
        try:
            data = self._fs.cat_file(self.path, start=pos, end=end)
        except (OSError, ValueError):
            # size unknown: a range starting at the end is refused (S3: InvalidRange)
            if self._size is None and pos >= self.size:
                return b""
            raise
        if len(data) < end - pos:  # a short ranged read stops at the end of the file
            self._size = pos + len(data)
        return data

    def reader(self) -> "RangeReader":
        """A seekable file object over this file (for pyarrow), reading with ``pread``."""
        return RangeReader(self)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RangeReader(io.RawIOBase):
    """A read-only, seekable file object over a ``RangeFile``: each ``read`` is one
    ``pread`` (a remote one: one ranged GET, or served from the last small block), with
    none of fsspec's per-file requests (its S3 files ask the object's details before
    their first read)."""

    def __init__(self, rf: RangeFile):
        super().__init__()
        self._rf, self._pos = rf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: None}[whence]
        self._pos = (self._rf.size if base is None else base) + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._rf.size - self._pos
        data = self._rf.pread(n, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


__all__ = ["RangeReader", "is_remote", "absolute", "filesystem", "glob", "size", "open_binary", "RangeFile"]
