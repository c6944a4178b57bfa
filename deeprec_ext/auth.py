"""Access control for a job: one shared job token on every RPC, TLS when certificates exist.

The settings live in the process environment, so that every process the AIMaster starts
(and every process of a pod) inherits them and ``grpc_util`` can apply them to each channel
and server without new arguments threading through the code:

  DEEPREC_TOKEN_FILE       file holding the job token (Kubernetes: a Secret mounted read-only).
                           The *file* travels in the environment, never the secret itself:
                           the environment of a process is readable in ``/proc`` and in
                           ``kubectl describe``.
  DEEPREC_TLS_DIR          directory with ``ca.crt`` (clients) and ``tls.crt`` + ``tls.key``
                           (servers): the layout of a ``kubernetes.io/tls`` Secret.
  DEEPREC_TLS_SERVER_NAME  the name the certificate is issued for (default ``deeprec``).
                           Members dial each other by pod IP, so clients check this one
                           name instead of the address.

Servers refuse a call whose ``authorization: Bearer <token>`` metadata is missing or wrong
with UNAUTHENTICATED, before any servicer code runs, so a refused call changes nothing.
"""
from __future__ import annotations

import hmac
import os
import threading
import time
from dataclasses import dataclass

import grpc

TOKEN_FILE_ENV = "DEEPREC_TOKEN_FILE"
TLS_DIR_ENV = "DEEPREC_TLS_DIR"
TLS_SERVER_NAME_ENV = "DEEPREC_TLS_SERVER_NAME"
DEFAULT_SERVER_NAME = "deeprec"
METADATA_KEY = "authorization"
# a rotated Secret shows up in the mounted file within kubelet's sync period; re-reading
# the file at most this often keeps a stat() off every hot-path RPC
_RELOAD_SECONDS = 1.0


class AuthError(ValueError):
    """A token file or certificate cannot be used; the message names the file."""


@dataclass(frozen=True)
class Settings:
    token_file: str = ""
    tls_dir: str = ""
    server_name: str = DEFAULT_SERVER_NAME

    @property
    def client_tls(self) -> bool:
        return bool(self.tls_dir) and os.path.exists(os.path.join(self.tls_dir, "ca.crt"))

    @property
    def server_tls(self) -> bool:
        return bool(self.tls_dir) and all(os.path.exists(os.path.join(self.tls_dir, f))
                                          for f in ("tls.crt", "tls.key"))


def settings() -> Settings:
    """This process's access-control settings (from its environment)."""
    return Settings(token_file=os.environ.get(TOKEN_FILE_ENV, ""),
                    tls_dir=os.environ.get(TLS_DIR_ENV, ""),
                    server_name=os.environ.get(TLS_SERVER_NAME_ENV, "") or DEFAULT_SERVER_NAME)


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise AuthError(f"cannot read token file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise AuthError(f"token file {path} is not text") from exc
    if not token:
        raise AuthError(f"token file {path} is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise AuthError(f"token file {path}: the token must be one line of printable characters "
                        "without spaces (it travels as gRPC metadata)")
    return token


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise AuthError(f"cannot read {path}: {exc.strerror}") from exc


def configure(token_file: str | None = None, tls_dir: str | None = None,
              server_name: str | None = None) -> Settings:
    """Validate and export the settings to this process and the processes it starts.

    Paths are made absolute: children may run in another working directory."""
    if token_file:
        token_file = os.path.abspath(token_file)
        read_token(token_file)  # fail now, with the file's name, not on the first RPC
        os.environ[TOKEN_FILE_ENV] = token_file
    if tls_dir:
        tls_dir = os.path.abspath(tls_dir)
        if not os.path.isdir(tls_dir):
            raise AuthError(f"TLS directory {tls_dir} does not exist")
        present = {f for f in ("ca.crt", "tls.crt", "tls.key") if os.path.exists(os.path.join(tls_dir, f))}
        if "ca.crt" not in present and len(present) < 2:
            raise AuthError(f"TLS directory {tls_dir} holds neither ca.crt (to verify servers) "
                            "nor tls.crt + tls.key (to serve)")
        os.environ[TLS_DIR_ENV] = tls_dir
    if server_name:
        os.environ[TLS_SERVER_NAME_ENV] = server_name
    return settings()


def child_env(s: Settings | None = None) -> dict[str, str]:
    """The variables a started process needs to join this job's access control."""
    s = s or settings()
    env = {}
    if s.token_file:
        env[TOKEN_FILE_ENV] = s.token_file
    if s.tls_dir:
        env[TLS_DIR_ENV] = s.tls_dir
        env[TLS_SERVER_NAME_ENV] = s.server_name
    return env


class TokenSource:
    """The token in a file, re-read when the file changes (Secret rotation)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp: tuple | None = None
        self._token = read_token(path)
        self._stamp = self._stat()

    def _stat(self):
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def get(self) -> str:
        now = time.monotonic()
        if now - self._checked < _RELOAD_SECONDS:
            return self._token
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                try:
                    self._token = read_token(self.path)
                    self._stamp = stamp
                except AuthError:
                    pass  # mid-update by kubelet: keep the last good token
            return self._token


_sources: dict[str, TokenSource] = {}
_sources_lock = threading.Lock()


def token_source(path: str) -> TokenSource:
    with _sources_lock:
        src = _sources.get(path)
        if src is None:
            src = _sources[path] = TokenSource(path)
        return src


# -- server side ------------------------------------------------------------------------
class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call without the job token with UNAUTHENTICATED, before the servicer."""

    def __init__(self, source: TokenSource):
        self.source = source

    def _allowed(self, metadata) -> bool:
        expected = ("Bearer " + self.source.get()).encode()
        for key, value in metadata or ():
            if key == METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        if self._allowed(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        has_token = any(k == METADATA_KEY for k, _ in handler_call_details.invocation_metadata or ())
        message = (f"{handler_call_details.method}: "
                   + ("wrong job token" if has_token else "no job token (authorization metadata)")
                   + f"; give the job's token file (--token-file or {TOKEN_FILE_ENV})")
        return _refusing_handler(handler, message)


def _refusing_handler(handler, message: str):
    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(_request, context):  # a generator, as a streaming response must be
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    # the request is not parsed: a caller without the token gets UNAUTHENTICATED whatever
    # it sends (parsing first answered undecodable bytes INTERNAL, before the token check)
    kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


def server_interceptors(s: Settings | None = None) -> list:
    """The interceptors a server of this process needs: the token check when a token is set."""
    s = s or settings()
    return [TokenInterceptor(token_source(s.token_file))] if s.token_file else []


def server_credentials(s: Settings | None = None) -> grpc.ServerCredentials | None:
    s = s or settings()
    if not s.server_tls:
        return None
    key = _read(os.path.join(s.tls_dir, "tls.key"))
    cert = _read(os.path.join(s.tls_dir, "tls.crt"))
    return grpc.ssl_server_credentials([(key, cert)])


# -- client side ------------------------------------------------------------------------
class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, source: TokenSource):
        self.source = source

    def _details(self, d):
        md = list(d.metadata or ())
        md.append((METADATA_KEY, "Bearer " + self.source.get()))
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(
            d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def client_channel(address: str, options: list, s: Settings | None = None) -> grpc.Channel:
    """A channel to ``address`` carrying this process's token, over TLS when configured."""
    s = s or settings()
    if s.client_tls:
        tls = os.path.join(s.tls_dir, "ca.crt")
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls))
        # peers are dialled by IP or pod DNS name; the certificate names the job instead
        channel = grpc.secure_channel(address, creds,
                                      options=[*options, ("grpc.ssl_target_name_override", s.server_name)])
    else:
        channel = grpc.insecure_channel(address, options=options)
    if s.token_file:
        channel = grpc.intercept_channel(channel, _TokenMetadata(token_source(s.token_file)))
    return channel


def is_unauthenticated(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


def unauthenticated_hint(address: str) -> str:
    """The CLI message for a refused call."""
    s = settings()
    have = f"the token in {s.token_file} was refused" if s.token_file else "no job token was given"
    return (f"{address} refused the call (UNAUTHENTICATED): {have}; pass --token-file FILE "
            f"or set {TOKEN_FILE_ENV} to the job's token file")


def is_loopback(host: str) -> bool:
    import ipaddress
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket shows ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
