"""The repository's top level shadows no package. `python -m pytest`, `python -m hybridengine` and any script run
from the root put the root first on sys.path, so a folder there named like a package on the index replaces that
package for everything imported in the process (the Triton sources once lived in `kernels/`, and transformers
imports Hugging Face's `kernels`: 169 tests failed on a fresh clone)."""

import importlib.metadata
import importlib.machinery
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKED_FREE = {"hybridengine", "hybridengine_bench", "tests", "docs", "csrc", "bin"}
"""The importable top-level folders, each looked up on PyPI when it was added (no project of that name). A new
folder fails `test_every_importable_top_level_folder_was_checked` until its name is checked and added here."""


def importable_top_level() -> set[str]:
    """Names `import X` finds at the root: tracked folders whose name is an identifier (a package, or a
    namespace portion without `__init__.py`). setup.py, the one top-level module, is the build's entry point."""
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        folders = {line.split("/", 1)[0] for line in tracked.splitlines() if "/" in line}
    except (OSError, subprocess.CalledProcessError):  # a source tree without git: every folder
        folders = {p.name for p in ROOT.iterdir() if p.is_dir()}
    return {name for name in folders if name.isidentifier() and not name.startswith(".")}


def test_every_importable_top_level_folder_was_checked():
    unchecked = importable_top_level() - CHECKED_FREE
    assert not unchecked, (f"top-level folders {sorted(unchecked)} are importable from the repository root: check "
                           f"that https://pypi.org/project/NAME/ does not exist, then add them to CHECKED_FREE (or "
                           f"move them under hybridengine/)")


def test_no_installed_package_is_shadowed_by_the_root():
    """Every top-level module that an installed distribution provides resolves, with the root first on the
    path, to the distribution's file, not to a folder or module of the repository."""
    shadowed = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        if not name.isidentifier() or "hybridengine" in dists:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])
        if spec is not None and spec.origin is not None:  # a namespace portion (origin None) loses to a package
            shadowed[name] = (dists, spec.origin)
    assert not shadowed, f"the repository root shadows installed packages: {shadowed}"


def _on_pypi(name: str) -> bool | None:
    """True when PyPI has a project of that name, False when it has none, None when PyPI does not answer."""
    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=10) as response:
            json.load(response)
            return True
    except urllib.error.HTTPError as e:
        return False if e.code == 404 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def test_no_importable_top_level_folder_is_a_project_on_pypi():
    """Asked of PyPI itself (names taken since CHECKED_FREE was written show here); skipped offline."""
    answers = {name: _on_pypi(name) for name in sorted(importable_top_level())}
    if all(answer is None for answer in answers.values()):
        pytest.skip("pypi.org does not answer from this machine")
    taken = [name for name, answer in answers.items() if answer]
    assert not taken, f"top-level folders named like projects on PyPI (they shadow them when installed): {taken}"
