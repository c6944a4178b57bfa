"""The AIMaster side of access control: the job token checked on every RPC of the AIMaster.

(The PS installs the same check in ``deeprec_ext/ps/__main__.py``; TLS is applied to every
server and channel by ``deeprec_ext.grpc_util`` from the process settings.)
"""
from __future__ import annotations

from aimaster.config import ConfigError, JobConfig
from aimaster.plugins import MasterPlugin
from deeprec_ext import auth


class AccessControlPlugin(MasterPlugin):
    name = "access-control"

    def __init__(self, settings: auth.Settings):
        self.settings = settings

    def interceptors(self) -> list:
        return auth.server_interceptors(self.settings)


def access_control_plugin(config: JobConfig) -> AccessControlPlugin | None:
    """Export the job's security settings to this process and its children (so the
    launched PS and workers carry the token and check it), then guard the AIMaster."""
    sec = config.security
    try:
        s = auth.configure(sec.token_file or None, sec.tls_dir or None, sec.tls_server_name or None)
    except auth.AuthError as exc:
        raise ConfigError(f"security: {exc}") from exc
    return AccessControlPlugin(s) if s.token_file else None
