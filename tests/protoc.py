"""Google's own protobuf classes for our ``.proto`` files, for wire-compatibility tests.

The tests compare betterproto2's encoding (and the agent's hand-written
codec) with what protoc's Python classes make of the same definitions.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def google_modules(
    proto_dir: Path, sources: Sequence[Path], out: Path, *, includes: Sequence[Path] = ()
) -> dict[str, ModuleType]:
    """Run protoc on ``sources`` into ``out``; return each ``<stem>_pb2`` module by stem.

    ``includes``: further folders that the sources import from (their
    ``_pb2`` modules must be generated too, by listing them in ``sources``).
    """
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            *(f"-I{i}" for i in includes),
            f"--python_out={out}",
            *(str(s) for s in sources),
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    try:
        return {s.stem: importlib.import_module(f"{s.stem}_pb2") for s in sources}
    finally:
        sys.path.remove(str(out))
