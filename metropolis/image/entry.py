"""The image's entry point: ``python3 IMAGE ARGS`` runs ``python -m metropolis ARGS``
with the etcd the image bundles.

By the time shiv's bootstrap calls :func:`main`, it has extracted the
image's site-packages to its cache (on first start) and put them first on
``sys.path``. :func:`main` then checks the bundle (:func:`bundled_etcd`:
right Python, etcd's digest) before it imports anything compiled, points
the consensus service at the bundled etcd through
``METROPOLIS_ETCD_BINARY``, and hands over to the node CLI with the same arguments.
"""

from __future__ import annotations

import os
import sys

from metropolis.image.bundle import bundled_etcd
from metropolis.image.errors import ImageError

__all__ = ["main"]


def main() -> int:
    """Run the node CLI on ``sys.argv``; 1 with one line on stderr if the bundle is bad."""
    try:
        etcd = bundled_etcd()
    except ImageError as exc:
        sys.stderr.write(f"metropolis image: {exc}\n")
        return 1
    # Imported only now: these load trio and the compiled dependencies.
    from metropolis.__main__ import main as cli
    from metropolis.consensus.process import ETCD_BINARY_ENV
    from metropolis.roleserve.bootinfo import IMAGE_ENV

    if etcd is not None:
        os.environ[ETCD_BINARY_ENV] = str(etcd)
    # ``python3 IMAGE``: the zipapp is argv[0]. Set here, not inherited: a
    # node started by another node's process must report its own image.
    os.environ[IMAGE_ENV] = os.path.abspath(sys.argv[0])
    return cli(sys.argv[1:])
