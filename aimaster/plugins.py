"""Features that hook into the AIMaster without editing its core loop.

Gazer statistics, the autoscale policy, access control and the consistent (sync) mode each
ship a ``MasterPlugin``; ``load_plugins`` builds the ones a job's configuration asks for.
Hooks get the job's read-only ``JobView`` (aimaster/view.py), never the JobMaster: a
plugin asks for changes through the view's operations. Hooks run on the thread named in
their docstring and must not block for long: the main loop ticks every 0.2 s and RPC
threads serve training.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import grpc

    from aimaster.config import JobConfig
    from aimaster.view import JobView


class MasterPlugin:
    name = "plugin"

    def interceptors(self) -> list:
        """grpc.ServerInterceptor objects for the AIMaster's server (before it binds)."""
        return []

    def on_start(self, master: "JobView", server: "grpc.Server") -> None:
        """Add services to the server; called once, before it starts."""

    def on_tick(self, master: "JobView") -> None:
        """Main loop thread, about five times a second. May call master.scale()."""

    def on_heartbeat(self, master: "JobView", request) -> None:
        """RPC thread: a member's HeartbeatRequest, after the registry took it."""

    def on_status(self, master: "JobView", response) -> None:
        """RPC thread: fill this plugin's fields of a StatusResponse."""

    def on_progress(self, master: "JobView", parts: list) -> None:
        """Main loop thread: append this plugin's pieces (strings) to the progress line."""

    def around_migration(self, master: "JobView"):
        """A context manager entered just before table rows move between PS (scale,
        rebalance) and left once the new routing is published. Default: nothing."""
        return contextlib.nullcontext()

    def on_stop(self, master: "JobView") -> None:
        """Main loop thread, when the job ends, before the members are stopped."""


# name -> "module:function" building the feature's plugin from the job config (None when
# the job does not use it); imported only when a job is loaded.
FACTORIES: dict[str, str] = {
    "access-control": "aimaster.access:access_control_plugin",
    "autoscale": "aimaster.autoscale:create",
    "consistent": "aimaster.consistent:create",
    "gazer": "aimaster.monitor:create",
    "stragglers": "aimaster.stragglers:create",
}


def load_plugins(config: "JobConfig") -> list[MasterPlugin]:
    out = []
    for name, spec in FACTORIES.items():
        module, func = spec.split(":")
        plugin = getattr(importlib.import_module(module), func)(config)
        if plugin is not None:
            out.append(plugin)
    return out
