"""Root test configuration.

Fixtures that start real components live one per module in ``tests/fixtures/``
(``postgres.py``, ``etcd.py``, ``sshd.py``, ...). Every module there is loaded
as a pytest plugin, so any test can ask for any of them by name.
"""

from __future__ import annotations

from pathlib import Path

pytest_plugins = [
    f"tests.fixtures.{path.stem}"
    for path in sorted((Path(__file__).parent / "fixtures").glob("*.py"))
    if path.stem != "__init__"
]
