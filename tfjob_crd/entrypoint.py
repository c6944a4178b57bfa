"""Container entrypoint of every role in a TFJob: ``python -m tfjob_crd.entrypoint -- CMD...``.

Sets the member id from the pod's replica type and index (downward API), replaces
``{python}`` in the command as the local launcher does, then execs the command so that it
is PID 1 of its container and gets the SIGTERM of a preemption directly. ``--idle`` waits
for SIGTERM instead (the Chief's tensorflow container of a PS-only job).
"""
from __future__ import annotations

import os
import signal
import sys

from tfjob_crd.naming import REPLICA_INDEX_ENV, REPLICA_TYPE_ENV, member_id

MEMBER_ID_ENV = "DEEPREC_MEMBER_ID"  # as deeprec_ext.member (kept import-free of it: fast start)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--idle"]:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        return 0
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("entrypoint: error: no command after --", file=sys.stderr)
        return 2
    rtype, index = os.environ.get(REPLICA_TYPE_ENV, ""), os.environ.get(REPLICA_INDEX_ENV, "")
    if rtype and not os.environ.get(MEMBER_ID_ENV):
        if not index.isdigit():
            print(f"entrypoint: error: {REPLICA_INDEX_ENV}={index!r} is not a pod index", file=sys.stderr)
            return 2
        os.environ[MEMBER_ID_ENV] = member_id(rtype, int(index))
    cmd = [c.replace("{python}", sys.executable) for c in argv]
    sys.stdout.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"entrypoint: error: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
