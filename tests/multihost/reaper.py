"""Run a command as a child subreaper (``PR_SET_CHILD_SUBREAPER``): every process it leaves
behind is reparented here and reaped, until the command and all of them have exited; exits
with the command's status. What a container's init does for its processes.

The harness starts a head host's Ray under it, from the root network namespace: when every
process of that host is SIGKILLed (the head lost), they are reaped here instead of staying
zombies that ``ray start --head`` would take for a GCS still running, and the head can be
started again on the same host. Never imports the project.

Usage: ``python reaper.py COMMAND [ARG ...]``
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: reaper.py COMMAND [ARG ...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"reaper: prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"reaper: cannot run {argv[0]}: {exc}", file=sys.stderr)
            os._exit(127)
    status = None
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:  # the command and everything it left have exited
            break
        except InterruptedError:
            continue
        if pid == child:
            status = raw
    return os.waitstatus_to_exitcode(status) if status is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
