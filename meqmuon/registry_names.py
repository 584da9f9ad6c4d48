"""The optimizer registry's names, read from its source without importing it (and torch).

``meqmuon --help``, ``meqmuon train --help`` and argparse's errors answer without importing torch
(~2 s), but the help texts list the registry's names (``--optimizer``, ``compare --optimizers``,
``memory --optimizers``, ``ablation --optimizers``), and :mod:`meqmuon.optim.registry` holds the
optimizer classes, so importing it imports torch. The names and the tables each optimizer is a row of
are literals in the registry's ``_SPECS`` (``OptimizerSpec(name, cls, ..., demo=..., memory_row=...,
ablation_row=...)``): :func:`registry_names` reads them with :mod:`ast`, in the registry's own order and
by its own rules, so the registry stays the one place that states them. ``tests/test_cli.py`` checks
the result equals the imported registry's ``REGISTRY``, ``DEMO_NAMES``, ``MEMORY_NAMES`` and
``ABLATION_NAMES``; a ``_SPECS`` written in another form is an error here, not a wrong list.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["RegistryNames", "registry_names"]

REGISTRY_SOURCE = Path(__file__).resolve().parent / "optim" / "registry.py"


class RegistryNames(NamedTuple):
    """The registry's name lists (:mod:`meqmuon.optim.registry`'s ``REGISTRY`` keys and its ``*_NAMES``)."""

    names: tuple[str, ...]  # every optimizer, in the registry's order
    demo: tuple[str, ...]  # DEMO_NAMES: ``meqmuon compare``'s default optimizers
    memory: tuple[str, ...]  # MEMORY_NAMES: rows of ``meqmuon memory``'s default table, in order
    ablation: tuple[str, ...]  # ABLATION_NAMES: rows of the component ablation, in order


@functools.cache
def registry_names(source: Path = REGISTRY_SOURCE) -> RegistryNames:
    """The names of the registry's ``_SPECS`` table in ``source`` (see the module docstring)."""
    tree = ast.parse(source.read_text(), str(source))
    fields = _spec_fields(tree, source)
    specs = []
    for call in _specs_table(tree, source):
        given = dict(zip(fields, call.args, strict=False)) | {k.arg: k.value for k in call.keywords if k.arg}
        try:
            specs.append({key: ast.literal_eval(given[key]) if key in given else None
                          for key in ("name", "demo", "memory_row", "ablation_row")})
        except ValueError:
            raise RuntimeError(f"{source}:{call.lineno}: an OptimizerSpec whose name or table rows are not "
                               "literals; meqmuon/registry_names.py reads them without importing torch") from None

    def rows(key: str) -> tuple[str, ...]:  # the registry's own rule: sorted by row, those with one
        return tuple(s["name"] for s in sorted(specs, key=lambda s: s[key] or 0) if s[key] is not None)

    return RegistryNames(tuple(s["name"] for s in specs), tuple(s["name"] for s in specs if s["demo"]),
                         rows("memory_row"), rows("ablation_row"))


def _spec_fields(tree: ast.Module, source: Path) -> list[str]:
    """``OptimizerSpec``'s fields in order (positional arguments fill them in this order)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "OptimizerSpec":
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise RuntimeError(f"{source}: no class OptimizerSpec")


def _specs_table(tree: ast.Module, source: Path) -> list[Any]:
    """The ``OptimizerSpec(...)`` calls of ``_SPECS = (...)``, in order."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_SPECS" for t in node.targets):
            if isinstance(node.value, ast.Tuple | ast.List) and all(
                    isinstance(e, ast.Call) and getattr(e.func, "id", None) == "OptimizerSpec"
                    for e in node.value.elts):
                return list(node.value.elts)
    raise RuntimeError(f"{source}: no _SPECS = (OptimizerSpec(...), ...) table")
