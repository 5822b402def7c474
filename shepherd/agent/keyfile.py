"""The agent's Ed25519 private seed, kept in a file beside it.

The 32-byte seed lives in ``<agent>.key``, mode 0600, created atomically on
first run and reused on every later run: the key is the machine's identity
towards the BMaaS endpoint, so it must survive re-runs of the takeover. A
key file that exists but is not 32 bytes is an error, never silently
replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from .errors import AgentError


def load_or_create_seed(path: str, warnings: list[str]) -> bytes:
    """Return the private seed stored at ``path``, creating it if absent.

    The file must be a regular file owned by us: opened without following a
    symlink (one planted at the path is refused, never read or chmodded
    through), checked and tightened through its descriptor. Creation writes
    an unpredictably named temporary file (exclusive create, 0600) and links
    it into place, which fails if the key appeared meanwhile (then that one
    is used): a crash never leaves a truncated key, and two agents starting
    at once agree on one key. Every failure is an :class:`AgentError`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_seed(path, warnings)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AgentError(f"key file {path} is a symbolic link; refusing it") from exc
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AgentError(f"key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise AgentError(f"key file {path} is owned by uid {st.st_uid}, not by us")
        seed = os.read(fd, 33)
        if len(seed) != 32:
            raise AgentError(f"key file {path} holds {st.st_size} bytes, want 32; not replacing it")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            os.fchmod(fd, 0o600)
            warnings.append(f"key file {path} had mode {mode:04o}, tightened to 0600")
        return seed
    except OSError as exc:
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _create_seed(path: str, warnings: list[str]) -> bytes:
    seed = os.urandom(32)
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    try:
        try:
            os.write(fd, seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        return load_or_create_seed(path, warnings)  # another run created it: use that
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return seed
