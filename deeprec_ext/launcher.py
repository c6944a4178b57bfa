"""Is the local launcher (the AIMaster that started this process) still alive?

The local scaler starts every member with ``DEEPREC_PARENT_PID`` and asks the kernel to
SIGTERM it when the AIMaster dies (PR_SET_PDEATHSIG). That SIGTERM can arrive while the
dead AIMaster is still exiting or a zombie, when ``kill(pid, 0)`` (and, with a
multi-threaded parent, ``getppid()``) still say it lives; a member that believed it then
took the signal as a polite request to leave and retried a dead job for minutes. So: a
zombie or exiting parent is dead, and a member that got SIGTERM keeps watching for a while
(:func:`watch_launcher`).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

PARENT_ENV = "DEEPREC_PARENT_PID"


def launcher_alive() -> bool:
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return True  # not started by the local launcher (e.g. a pod): assume the master lives
    try:
        pid = int(parent)
    except ValueError:
        return False
    if os.getppid() != pid:
        return False  # re-parented: the launcher is gone
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X", "x")  # zombie or dead: exiting counts as gone


def watch_launcher(on_gone: Callable[[], None], seconds: float = 30.0,
                   interval: float = 0.2) -> threading.Thread | None:
    """After a SIGTERM that looked like a request to leave: call ``on_gone`` if the
    launcher turns out to be dying after all (checked every ``interval`` for ``seconds``)."""
    if not os.environ.get(PARENT_ENV):
        return None

    def watch() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not launcher_alive():
                on_gone()
                return
            time.sleep(interval)
    t = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    t.start()
    return t
