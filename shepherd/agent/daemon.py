"""Running on after the takeover: detaching from SSH, the pid file, log lines.

The detached agent's stdio goes to its log file; `log` writes a line there
(stderr, before `detach`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from .files import read_int, read_text


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sys.stderr.write(f"{stamp} agent: {message}\n")
    sys.stderr.flush()


def replace_running_agent(pid_file: str) -> None:
    """Stop an agent still running from an earlier takeover, and record our pid.

    A takeover without a reboot (a provider that cannot reboot) finds the old
    agent possibly alive; two would heartbeat for one machine. Only a process
    whose command line names this very agent file is signalled. A node that an
    install started (`install`) is never signalled: it runs in a session of
    its own and outlives every agent.
    """
    old = read_int(pid_file)
    if old and old != os.getpid():
        cmdline = (read_text(f"/proc/{old}/cmdline") or "").split("\0")
        if any(os.path.abspath(arg) == os.path.abspath(sys.argv[0]) for arg in cmdline if arg):
            with contextlib.suppress(OSError):
                os.kill(old, signal.SIGTERM)
    tmp = f"{pid_file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, pid_file)


def detach(log_file: str, pid_file: str) -> bool:
    """Double-fork into a new session with stdio away from the SSH channel.

    Returns False in the original process (which then exits, ending the SSH
    session) and True in the detached daemon. The original process returns
    only once the daemon has recorded its pid (`replace_running_agent`), or
    died trying: whoever started the agent finds it by its pid file as soon
    as the start has ended (to stop it, say), not some time later.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    recorded, record = os.pipe()
    child = os.fork()
    if child:
        os.close(record)
        os.waitpid(child, 0)
        with contextlib.suppress(OSError):
            os.read(recorded, 1)  # end of file once the daemon closed its end
        os.close(recorded)
        return False
    os.close(recorded)
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir("/")
    try:
        replace_running_agent(pid_file)
    finally:
        os.close(record)
    return True
