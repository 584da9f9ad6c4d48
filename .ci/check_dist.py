"""Check a built sdist and wheel against the source tree: ``python .ci/check_dist.py DIST_DIR [ROOT]``.

- one wheel and one sdist, named for ``meqmuon.__version__`` (read from the source, not imported);
- the wheel holds every package file of the tree (``git ls-files meqmuon``, or every file under ``meqmuon/``
  but ``__pycache__`` outside a git checkout), and nothing else but its metadata, ``LICENSE`` among it;
- the wheel's ``METADATA`` says that version, and ``CHANGELOG.md``'s first entry is it;
- the sdist holds the package files, ``pyproject.toml``, ``README.md``, ``LICENSE``, ``CHANGELOG.md`` and the tests.

Prints each problem and exits 1 if there is one, so that a package file the build leaves out is seen.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

NAME = "meqmuon"


def version(root: Path) -> str:
    """``__version__`` of the package's ``__init__.py``, by reading it."""
    tree = ast.parse((root / NAME / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"no __version__ in {root / NAME / '__init__.py'}")


def changelog_version(root: Path) -> str | None:
    """The version of ``CHANGELOG.md``'s first ``## X.Y.Z`` entry."""
    m = re.search(r"^## (\S+)", (root / "CHANGELOG.md").read_text(), re.M)
    return m.group(1) if m else None


def package_files(root: Path) -> set[str]:
    """The package's files, relative to ``root``: tracked ones in a git checkout, else every file under it."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", NAME], capture_output=True, check=True)
        files = {f for f in out.stdout.decode().split("\0") if f}
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    return {p.relative_to(root).as_posix() for p in (root / NAME).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def problems(dist: Path, root: Path) -> list[str]:
    found: list[str] = []
    v = version(root)
    if changelog_version(root) != v:
        found.append(f"CHANGELOG.md's first entry is {changelog_version(root)!r}, the package's version {v!r}")
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if [w.name for w in wheels] != [f"{NAME}-{v}-py3-none-any.whl"]:
        found.append(f"wheels {[w.name for w in wheels]}, expected one {NAME}-{v}-py3-none-any.whl")
    if [s.name for s in sdists] != [f"{NAME}-{v}.tar.gz"]:
        found.append(f"sdists {[s.name for s in sdists]}, expected one {NAME}-{v}.tar.gz")
    files = package_files(root)
    for wheel in wheels[:1]:
        names = set(zipfile.ZipFile(wheel).namelist())
        info = f"{NAME}-{v}.dist-info/"
        found += [f"wheel: {f} missing" for f in sorted(files - names)]
        found += [f"wheel: {f} is not a package file" for f in sorted(names - files) if not f.startswith(info)]
        if f"{info}licenses/LICENSE" not in names:
            found.append("wheel: no LICENSE in its metadata")
        if f"{info}METADATA" in names:
            meta = zipfile.ZipFile(wheel).read(f"{info}METADATA").decode()
            if f"\nVersion: {v}\n" not in meta:
                found.append(f"wheel: METADATA does not say Version: {v}")
        else:
            found.append("wheel: no METADATA")
    for sdist in sdists[:1]:
        prefix = f"{NAME}-{v}/"
        names = {n.removeprefix(prefix) for n in tarfile.open(sdist).getnames()}
        wanted = files | {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"}
        found += [f"sdist: {f} missing" for f in sorted(wanted - names)]
        if not any(n.startswith("tests/test_") for n in names):
            found.append("sdist: no tests")
    return found


def main(argv: list[str]) -> int:
    dist = Path(argv[1])
    root = Path(argv[2]) if len(argv) > 2 else Path(__file__).resolve().parents[1]
    found = problems(dist, root)
    for p in found:
        print(f"check_dist: {p}")
    if not found:
        print(f"check_dist: {NAME} {version(root)}: the wheel holds its {len(package_files(root))} package files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
