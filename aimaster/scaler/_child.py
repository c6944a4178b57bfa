"""Exec wrapper for local children: ``python -m aimaster.scaler._child PARENT_PID -- CMD...``.

Asks the kernel to SIGTERM this process when its parent dies (PR_SET_PDEATHSIG), checks
the parent did not die already, then execs the real command (the setting survives exec).
Done here rather than in a ``preexec_fn``: running Python between fork and exec in a
process with gRPC threads can crash the child.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent = int(sys.argv[1])
    cmd = sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the setting took effect
        sys.exit(1)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
