"""Runs mypy on the `trainmover` package as it is installed (shared/ + services/ + examples/).

The repository's folders are mapped onto the import package by setup.py, which mypy
cannot follow through an editable install; so we lay out a tree of links with the
package's real shape under .build/mypy/ and check that.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".build" / "mypy"


def link_tree() -> Path:
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "trainmover"
    package.mkdir(parents=True)
    for entry in (ROOT / "shared").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "services").symlink_to(ROOT / "services")
    (package / "examples").symlink_to(ROOT / "examples")
    return TREE


def main() -> int:
    tree = link_tree()
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        "trainmover",
    ]
    return subprocess.call(cmd, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
