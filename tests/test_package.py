"""The package as it is built (issue 57): version, changelog, licence, and ``.ci/check_dist.py``, which CI runs on
the sdist and the wheel it builds (``.ci/package.sh``: then the wheel is installed in a fresh virtual
environment and runs the README's quick start). Here the checker itself is checked: on a wheel that lacks a
package file, or an sdist without its tests, it says which."""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import meqmuon

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".ci"))
import check_dist  # noqa: E402


def test_version_changelog_and_licence_agree():
    assert check_dist.version(REPO) == meqmuon.__version__ == check_dist.changelog_version(REPO)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dynamic"] == ["version"] and project["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    assert {"torchtitan", "lightning"} <= set(project["optional-dependencies"])


def _tree(root: Path, version: str = "9.9.9") -> None:
    (root / "meqmuon" / "sub").mkdir(parents=True)
    (root / "meqmuon" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (root / "meqmuon" / "sub" / "__init__.py").write_text("")
    (root / "meqmuon" / "sub" / "table.json").write_text("{}")  # package data
    (root / "CHANGELOG.md").write_text(f"# Changelog\n\n## {version} (today)\n")


def _dist(dist: Path, root: Path, leave_out: str = "", tests: bool = True) -> None:
    dist.mkdir()
    files = [p.relative_to(root).as_posix() for p in (root / "meqmuon").rglob("*") if p.is_file()]
    info = "meqmuon-9.9.9.dist-info"
    with zipfile.ZipFile(dist / "meqmuon-9.9.9-py3-none-any.whl", "w") as z:
        for f in files:
            if f != leave_out:
                z.write(root / f, f)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.4\nName: meqmuon\nVersion: 9.9.9\n")
        z.writestr(f"{info}/licenses/LICENSE", "MIT License")
    with tarfile.open(dist / "meqmuon-9.9.9.tar.gz", "w:gz") as tar:
        extra = ["pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"] + (["tests/test_x.py"] if tests else [])
        for f in files + extra:
            data = (root / f).read_bytes() if (root / f).exists() else b""
            member = tarfile.TarInfo(f"meqmuon-9.9.9/{f}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_check_dist_passes_a_complete_build(tmp_path):
    _tree(tmp_path / "src")
    _dist(tmp_path / "dist", tmp_path / "src")
    assert check_dist.problems(tmp_path / "dist", tmp_path / "src") == []


@pytest.mark.parametrize("missing", ["meqmuon/sub/__init__.py", "meqmuon/sub/table.json"])
def test_check_dist_names_a_missing_package_file(tmp_path, missing):
    _tree(tmp_path / "src")
    _dist(tmp_path / "dist", tmp_path / "src", leave_out=missing)
    assert check_dist.problems(tmp_path / "dist", tmp_path / "src") == [f"wheel: {missing} missing"]


def test_check_dist_names_a_stale_version_and_an_sdist_without_tests(tmp_path):
    _tree(tmp_path / "src")
    _dist(tmp_path / "dist", tmp_path / "src", tests=False)
    (tmp_path / "src" / "CHANGELOG.md").write_text("## 9.9.8\n")
    found = check_dist.problems(tmp_path / "dist", tmp_path / "src")
    assert found == ["CHANGELOG.md's first entry is '9.9.8', the package's version '9.9.9'", "sdist: no tests"]
