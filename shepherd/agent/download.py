"""Downloading the node image: bounded, resumed, retried, verified before use.

One GET of ``{scheme}://{host}:{port}{path}`` (http.client: no redirects
followed, no compression asked for) into a temporary file, TLS checked
with the caller's context (the CA from TakeoverInit). Bounded in size
(Content-Length, and the bytes counted as they come), per read and connect
(the socket timeout; reads return what one receive brings, so a trickling
server cannot stretch one read) and in total (a deadline over all attempts).

A broken connection, a timeout, HTTP 408, 429 or 5xx is retried with
exponential backoff (doubling from ``backoff_start`` up to ``backoff_cap``,
jittered to 50-100%, reset when an attempt made progress), resuming with
``Range: bytes=N-`` from what the file holds (206 must start at N; a 200
starts over, a 416 too). When the next pause would pass the deadline it
gives up, with the last cause. Any other status is final, and so is a
certificate the CA did not sign.

The SHA-256 is computed over the bytes as written and compared before the
caller gets the file: a file that does not match never leaves this module,
it is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import time
from typing import TYPE_CHECKING, Any

from .daemon import log
from .errors import AgentError

if TYPE_CHECKING:
    import ssl
    from typing import BinaryIO

PART_PREFIX, PART_SUFFIX = ".image-", ".part"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the image is: ``{scheme}://{host}:{port}{path}``."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds of a download (bytes, seconds)."""

    max_bytes: int
    #: Bound on connecting and on each read.
    read_timeout: float
    #: Bound on the whole download, retries included.
    deadline: float
    backoff_start: float
    backoff_cap: float


class DownloadFailed(AgentError):
    """The download failed for good; the message is the cause."""


class _Transient(Exception):
    """A download attempt failed in a way a retry may fix."""


@dataclasses.dataclass
class _Progress:
    file: BinaryIO
    hasher: Any = dataclasses.field(default_factory=hashlib.sha256)
    have: int = 0
    total: int | None = None

    def restart(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.hasher = hashlib.sha256()
        self.have = 0


def _content_range_start(value: str | None) -> tuple[int, int]:
    """``bytes START-END/TOTAL`` -> (START, TOTAL)."""
    match = re.fullmatch(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19})", value or "")
    if match is None:
        raise _Transient(f"bad Content-Range {value!r}")
    return int(match.group(1)), int(match.group(3))


def _attempt(
    source: Source,
    context: ssl.SSLContext | None,
    progress: _Progress,
    limits: Limits,
    deadline: float,
) -> None:
    """One GET (ranged when resuming), appending to ``progress``; returns when
    the file is complete, raises _Transient, OSError or HTTPException for a
    retry, DownloadFailed when retrying cannot help."""
    import http.client

    timeout = max(0.001, min(limits.read_timeout, deadline - time.monotonic()))
    conn: http.client.HTTPConnection
    if source.scheme == "https":
        conn = http.client.HTTPSConnection(
            source.host, source.port, timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection(source.host, source.port, timeout=timeout)
    try:
        headers = {"Accept-Encoding": "identity"}
        progress.total = None  # what this response says, not an earlier one
        if progress.have:
            headers["Range"] = f"bytes={progress.have}-"
        conn.request("GET", source.path, headers=headers)
        response = conn.getresponse()
        if response.status == 200:
            if progress.have:
                progress.restart()  # the server sends it all again
            length = response.getheader("Content-Length")
            if length is not None and re.fullmatch(r"[0-9]{1,19}", length):
                progress.total = int(length)
        elif response.status == 206 and progress.have:
            start, total = _content_range_start(response.getheader("Content-Range"))
            if start != progress.have:
                raise _Transient(f"asked for bytes from {progress.have}, got from {start}")
            progress.total = total
        elif response.status == 416 and progress.have:
            progress.restart()
            raise _Transient("the server refused the range; starting over")
        elif response.status in (408, 429) or response.status >= 500:
            raise _Transient(f"HTTP {response.status}")
        else:
            text = response.read(300).decode("utf-8", errors="replace")
            raise DownloadFailed(f"image server answered HTTP {response.status}: {text!r}")
        if progress.total is not None and progress.total > limits.max_bytes:
            raise DownloadFailed(
                f"image of {progress.total} bytes, over the bound of {limits.max_bytes}"
            )
        while True:
            if time.monotonic() > deadline:
                raise _Transient("download deadline passed")
            chunk = response.read1(256 * 1024)
            if not chunk:
                break
            progress.have += len(chunk)
            if progress.have > limits.max_bytes:
                raise DownloadFailed(f"image over the bound of {limits.max_bytes} bytes")
            progress.hasher.update(chunk)
            progress.file.write(chunk)
        if progress.total is not None and progress.have != progress.total:
            raise _Transient(f"connection ended at byte {progress.have} of {progress.total}")
    finally:
        conn.close()


def download(
    source: Source,
    sha256: str,
    directory: str,
    *,
    context: ssl.SSLContext | None,
    limits: Limits,
    label: str,
) -> str:
    """Download ``source`` into a new temporary file of ``directory`` (named
    ``PART_PREFIX...PART_SUFFIX``) and check that its SHA-256 is ``sha256``
    (hex); return the file's path. On any failure (DownloadFailed, with the
    cause) the file is removed. ``label`` begins the log lines of retries.
    """
    import http.client
    import random
    import ssl
    import tempfile

    start = time.monotonic()
    deadline = start + limits.deadline
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=PART_PREFIX, suffix=PART_SUFFIX)
    attempts = 0
    verified = False
    try:
        with os.fdopen(fd, "w+b") as f:
            progress = _Progress(f)
            delay = 0.0
            while True:
                before = progress.have
                try:
                    _attempt(source, context, progress, limits, deadline)
                    break
                except ssl.SSLCertVerificationError as exc:
                    # The same certificate would be refused again.
                    raise DownloadFailed(
                        f"the image server {source.url} is not trusted: {exc}"
                    ) from exc
                except (_Transient, OSError, http.client.HTTPException) as exc:
                    cause = str(exc) or type(exc).__name__
                    attempts += 1
                    log(f"{label}: download from {source.url}: {cause}")
                    if progress.have > before:
                        delay = 0.0  # it got somewhere: retry soon
                    delay = delay * 2 if delay else limits.backoff_start
                    delay = min(limits.backoff_cap, delay)
                    pause = delay * random.uniform(0.5, 1.0)
                    if time.monotonic() + pause >= deadline:
                        raise DownloadFailed(
                            f"download of {source.url} gave up after {attempts} attempts in "
                            f"{time.monotonic() - start:.0f}s: {cause}"
                        ) from exc
                    time.sleep(pause)
            got = progress.hasher.hexdigest()
            if got != sha256:
                raise DownloadFailed(
                    f"image digest mismatch: the server sent sha256:{got}, "
                    f"the request wants sha256:{sha256}"
                )
            f.flush()
            os.fsync(f.fileno())
        verified = True
        return tmp
    finally:
        if not verified:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
