"""An installed wheel has the files the packages read at run time: the BMDB's
migrations (``*.sql``) and the web UI's templates (``console/templates``).

The wheel is built from a copy of this tree by pip with the environment's
setuptools (no index, no build isolation), installed into a folder of its
own, and used from there by a Python that sees that folder and the
environment's site-packages, but not the editable install of this tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Not part of a build: caches, environments, version control.
_SKIP = shutil.ignore_patterns(
    ".git", ".nox", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests"
)


def _wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=_SKIP)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [wheel] = out.glob("monotrio-*.whl")
    return wheel


def test_an_installed_wheel_renders_pages_from_its_templates(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {p.relative_to(ROOT).as_posix() for p in (ROOT / "console/templates").iterdir()}
    assert templates and templates <= names
    assert "bmdb/migrations/0001_initial.sql" in names

    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    # -S: no site module, so no .pth file puts this tree on the path; the
    # environment's site-packages (for jinja2) comes after the install; and
    # not run from this tree (a -c script's path starts with its folder).
    script = (
        "import console.render as r, sys;"
        f"assert r.__file__.startswith({str(target)!r}), r.__file__;"
        "sys.stdout.write(r.render(r.Page('error.html', 'Gone', {'text': '<b>x</b>'})))"
    )
    path = f"{target}:{sysconfig.get_paths()['purelib']}:{sysconfig.get_paths()['platlib']}"
    result = subprocess.run(
        [sys.executable, "-S", "-c", script],
        env={"PYTHONPATH": path},
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "<h1>Gone</h1>" in result.stdout
    assert "<p>&lt;b&gt;x&lt;/b&gt;</p>" in result.stdout
