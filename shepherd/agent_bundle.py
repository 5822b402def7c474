"""The agent as uploaded: one zipapp built from the `shepherd.agent` package's files.

Layout of the archive::

    #!/usr/bin/env python3          (so that the file runs on its own too)
    __main__.py                     runs shepherd.agent.__main__.main()
    shepherd/__init__.py            empty: the Shepherd itself stays behind
    shepherd/agent/*.py             the agent's modules, as in the source tree

``python3 <file>`` runs the root ``__main__.py`` with the archive first on
``sys.path``, so the agent's modules import each other as in the source
tree, and ``sys.argv[0]`` is the uploaded file (the agent keeps its key,
pid file and log beside it).

The build is deterministic: members in name order, fixed timestamps and
modes, stored uncompressed (deflate's output may differ between zlib
versions). The same sources give the same bytes, so the SHA-256 that
`agent_zipapp` logs identifies what was uploaded. Sources only, no
bytecode: bytecode is bound to one Python version and the target's is
unknown, so zipimport compiles the modules at each start instead.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger("shepherd.agent_bundle")

#: The agent package's directory.
AGENT_DIR: Path = Path(__file__).with_name("agent")

#: What the archive's root ``__main__.py`` says (``sys.exit`` carries the status).
_ENTRY = b"import sys\n\nfrom shepherd.agent.__main__ import main\n\nsys.exit(main())\n"
_SHEBANG = b"#!/usr/bin/env python3\n"
# The earliest time a zip entry can carry: nothing of the build host leaks in.
_EPOCH = (1980, 1, 1, 0, 0, 0)


def agent_sources() -> dict[str, bytes]:
    """The agent's modules by their name in the archive (``shepherd/agent/x.py``)."""
    return {
        f"shepherd/agent/{path.name}": path.read_bytes() for path in sorted(AGENT_DIR.glob("*.py"))
    }


def build_zipapp(sources: Mapping[str, bytes]) -> bytes:
    """The zipapp of ``sources`` (names as `agent_sources` gives them), deterministically."""
    members = {"__main__.py": _ENTRY, "shepherd/__init__.py": b"", **sources}
    buffer = io.BytesIO()
    buffer.write(_SHEBANG)
    with zipfile.ZipFile(buffer, "a", zipfile.ZIP_STORED) as archive:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.create_system = 3  # Unix, whatever the build host
            archive.writestr(info, members[name])
    return buffer.getvalue()


@functools.cache
def agent_zipapp() -> bytes:
    """The bundled agent as uploaded, built once per process."""
    start = time.perf_counter()
    data = build_zipapp(agent_sources())
    # DEBUG: a command that fails before it does anything (a bad BMDB URL)
    # must say one line; what is uploaded is logged once the work starts.
    logger.debug(
        "agent zipapp: %d bytes, sha256 %s, built in %.1f ms",
        len(data),
        hashlib.sha256(data).hexdigest(),
        (time.perf_counter() - start) * 1000,
    )
    return data
