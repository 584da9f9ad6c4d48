"""Run against an installed meqmuon, from outside the tree: ``python .ci/installed.py README.md``.

Asserts that ``meqmuon`` and every module of it come from the interpreter's site-packages (no path of the
source tree on ``sys.path``), imports every module of the package (a module that needs an optional framework
which is not installed is named, and may fail only with that ImportError), and runs the README's quick start
(its first ``python`` block under "## Quick start") on a small model, then one step.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

#: Optional frameworks: a module that imports one of them may fail to import only for its absence.
OPTIONAL = ("torchtitan", "triton")

readme = Path(sys.argv[1]).resolve()
tree = readme.parent
assert not any(Path(p or ".").resolve().is_relative_to(tree) for p in sys.path), f"the tree is on sys.path: {sys.path}"

import meqmuon  # noqa: E402

site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert Path(meqmuon.__file__).resolve().is_relative_to(site), f"meqmuon from {meqmuon.__file__}, not {site}"
skipped = []
for info in pkgutil.walk_packages(meqmuon.__path__, "meqmuon."):
    try:
        module = importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        skipped.append(f"{info.name} ({e.name} not installed)")
        continue
    assert Path(module.__file__).resolve().is_relative_to(site), module.__file__

block = re.search(r"^## Quick start\n.*?```python\n(.*?)```", readme.read_text(), re.M | re.S).group(1)
model = nn.ModuleDict({"embed": nn.Embedding(32, 16), "body": nn.Linear(16, 16), "norm": nn.LayerNorm(16),
                       "head": nn.Linear(16, 32)})
scope = {"model": model}
exec(compile(block, "README.md (Quick start)", "exec"), scope)
before = model["body"].weight.detach().clone()
ids = torch.randint(0, 32, (4, 8))
logits = model["head"](model["norm"](model["body"](model["embed"](ids))))
nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
scope["opt"].step()
assert not torch.equal(before, model["body"].weight), "the quick start's optimizer did not step"
print(f"installed meqmuon {meqmuon.__version__} from {site}: every module imports"
      + (f" (not: {'; '.join(skipped)})" if skipped else "") + "; the README's quick start steps")
