"""The import graph of ``meqmuon/optim/`` (issue 35): no cycle, no upward import, every module placed.

``benchmarks/imports.py`` reads the sources with ``ast`` (module-level imports, imports inside functions and
under ``TYPE_CHECKING`` alike) and checks them against its table of layers; this test holds it at 0, and
checks that the counter does see a cycle and an upward import where there is one, so that 0 means 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import imports  # noqa: E402


def test_optim_has_no_import_cycle_and_no_upward_import():
    r = imports.report()
    assert r["cycles"] == [] and r["upward"] == [] and r["unplaced"] == [], r
    assert r["lazy"] == [], r  # no import hidden in a function either
    assert "optim.driver -> optim.newton_schulz" in r["edges"] and "optim.compiled -> optim.driver" in r["edges"]


def test_train_has_no_import_cycle():
    """``meqmuon/train/`` has no import cycle either, lazy imports counted (issue 55: ``config`` checked the
    device with a function of ``run``, which imports ``config``; the device now lives in ``train/device.py``)."""
    assert imports.report("train")["cycles"] == []


def test_import_meqmuon_loads_its_names_on_first_use():
    """``import meqmuon`` imports no torch (so the ``meqmuon`` command's ``--help`` need not); the public names,
    ``from meqmuon import *`` and the submodules as attributes work as when ``__init__`` imported them."""
    import os
    import subprocess

    code = """
import sys, meqmuon
assert "torch" not in sys.modules
import meqmuon.optim as optim
assert meqmuon.__all__ == ["functional", *optim.__all__]
assert all(getattr(meqmuon, n) is getattr(optim, n) for n in optim.__all__)
assert meqmuon.functional is sys.modules["meqmuon.functional"] and meqmuon.precision is sys.modules["meqmuon.precision"]
assert set(meqmuon.__all__) <= set(dir(meqmuon))
ns = {}
exec("from meqmuon import *", ns)
assert ns["MeqMuon"] is optim.MeqMuon and ns["build_optimizer"] is optim.build_optimizer
try:
    meqmuon.no_such_name
except AttributeError as e:
    assert "no attribute 'no_such_name'" in str(e)
else:
    raise AssertionError
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True)
    assert done.stdout == "ok\n", done.stderr[-2000:]


def test_the_counter_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "meqmuon"
    (pkg / "optim").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "optim" / "__init__.py").write_text("")
    (pkg / "optim" / "driver.py").write_text("from . import compiled\n")
    (pkg / "optim" / "compiled.py").write_text("def f():\n    from .driver import g\n")
    monkeypatch.setattr(imports, "ROOT", tmp_path)
    r = imports.report()
    assert r["cycles"] == [["optim.compiled", "optim.driver"]]
    assert r["upward"] == ["optim.driver:1 imports optim.compiled (layer 5 -> 7)"]
    assert r["lazy"] == ["optim.compiled:2 imports optim.driver (function)"]


def test_the_form_is_chosen_in_two_places():
    """Issue 35: ``foreach`` is resolved once per param group (``RoleOptimizer._prepare``) and the function
    that runs a call is picked by one chooser, ``RoleOptimizer._run``, a phase of ``step`` (the ``forms`` table of
    its path's executor, ``placement.EXECUTORS``, and a stepping rule's own ``step``/``step_foreach``); nothing else
    in ``optim/`` looks a form up (issue 55: not the exchange either). Counted on the sources, as anyone can with
    ``grep -n 'forms\\[\\|group.get("foreach")\\|step_foreach if' meqmuon/optim/*.py meqmuon/optim/*/*.py``."""
    import ast
    import re

    root = Path(__file__).resolve().parents[1] / "meqmuon" / "optim"
    hits = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                body = ast.get_source_segment(text, node) or ""
                if re.search(r'forms\[|FORMS\[|group\.get\("foreach"\)|step_foreach if', body):
                    hits.append(f"{path.relative_to(root)}:{node.name}")
    # methods are FunctionDefs too, and nested functions are counted where they are defined
    assert sorted(set(hits)) == ["engine.py:_prepare", "engine.py:_run"], hits


#: The bounds the package sets itself (the developers' brief; issue 46, item 10).
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80


def _oversized(root: Path) -> list[str]:
    """Every ``.py`` file under ``root`` over :data:`MAX_FILE_LINES` lines and every function (methods and
    nested functions included, decorators and docstring counted) over :data:`MAX_FUNCTION_LINES`."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            found.append(f"{path.relative_to(root)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - start + 1) > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
    return found


def test_no_file_over_700_lines_and_no_function_over_80():
    assert _oversized(Path(__file__).resolve().parents[1] / "meqmuon") == []


def test_the_size_check_sees_a_long_file_and_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text("def f():\n" + body + "\n" * (MAX_FILE_LINES - MAX_FUNCTION_LINES))
    (tmp_path / "short.py").write_text("def g():\n" + body[: -len(f"    x{MAX_FUNCTION_LINES - 1} = 79\n")])
    assert _oversized(tmp_path) == ["long.py: 701 lines", f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
