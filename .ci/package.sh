#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (python -m build, flit_core in its isolated
# environment), check the wheel holds every package file (check_dist.py), install the wheel into a fresh
# virtual environment outside the tree and run the README's quick start and an import of every module against
# it (installed.py). The venv reaches torch through a .pth naming the directory torch is installed in (no
# --system-site-packages, whose .pth files would put an editable install's tree on sys.path). The build must
# leave the tree as it found it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
before="$(git -C "$root" status --porcelain --ignored 2>/dev/null || true)"

"$PY" -m venv "$work/venv"
venv="$work/venv/bin/python"
site="$("$venv" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/torch-site.pth"
"$venv" -m pip install --quiet --disable-pip-version-check build
"$venv" -m build --outdir "$work/dist" "$root" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$venv" "$root/.ci/check_dist.py" "$work/dist" "$root"
"$venv" -m pip install --quiet --disable-pip-version-check --no-deps "$work/dist"/meqmuon-*.whl
(cd "$work" && "$venv" -I "$root/.ci/installed.py" "$root/README.md" && "$work/venv/bin/meqmuon" --help > /dev/null)

after="$(git -C "$root" status --porcelain --ignored 2>/dev/null || true)"
if [ "$before" != "$after" ]; then
    echo "package.sh: building changed the source tree:"; diff <(echo "$before") <(echo "$after") || true
    exit 1
fi
echo "package.sh: sdist and wheel built, the wheel installed and run outside the tree, the tree unchanged"
