"""Count import cycles and upward imports in ``meqmuon/optim/`` (issue 35): ``python benchmarks/imports.py``.

Reads the sources with ``ast`` (nothing is imported), so it counts every import statement: module level,
inside functions (a lazy import that hides a cycle counts as the cycle it hides), and under
``if TYPE_CHECKING:``. An import edge goes from a module to each module of the package it names
(``from . import compiled`` names ``optim.compiled``; ``from .driver import X`` names ``optim.driver``).

- A **cycle** is a strongly connected set of modules (Tarjan), printed with the edges inside it.
- An **upward import** is an edge from a module to one on a higher layer of :data:`LAYERS`: the
  architecture in one table, from the tensor maths up to the named optimizers (docs/design.md:
  ``cli -> train -> optim -> functional``; inside ``optim``, what a rule is below the table of
  Newton-Schulz methods, those below the driver, the driver below its compiled forms, the exchange and the
  table of paths, those below the rules and the engine). A module of the package that is in no layer is
  reported too, so a new file is placed deliberately.

Exit status 0 only with 0 cycles, 0 upward imports and 0 unplaced modules; ``--graph`` prints every edge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "meqmuon"

#: Layers, lowest first; a module may import modules of its own layer or lower ones (not its own layer's if
#: that closes a cycle, which the cycle count catches). Names are relative to ``meqmuon``.
LAYERS: list[list[str]] = [
    ["precision", "orthogonalization", "functional"],
    ["optim.views", "optim.inputs", "optim.distributed", "optim.owners", "optim.groups", "optim.structure",
     "optim.saved_state"],  # saved_state: load_state_dict with each state tensor in its saved dtype
    ["optim.calls", "optim.commit", "optim.blockwise", "optim.transfer", "optim.relay", "optim.assembly"],  # what a
    # rule call is handed; a step's gated writes; the row-blocked passes of eq. 9; what travels back from an owner;
    # the exchange's collective relayed through the nodes (relay_group); an owner's wholes put together
    ["optim.rule"],  # what a rule is: the elementwise and stepping protocols
    ["optim.newton_schulz"],  # the table of Newton-Schulz methods, their cost
    ["optim.driver"],  # HiddenRule, stacks, the seam (pre -> NS -> post)
    ["optim.forms", "optim.shared_ns"],  # the eager forms (per tensor, batched): inputs from the unchanged momentum,
    # writes last; one unit's Newton-Schulz shared by a block of ranks (ns_group)
    ["optim.compiled", "optim.exchange"],  # compiled forms; the exchange
    ["optim.whole_step", "optim.placement"],  # a stepping rule's whole tensors through the exchange; paths and who
    # runs them
    ["optim.rules.adam", "optim.rules.scale", "optim.rules.muon", "optim.rules.meqmuon", "optim.rules.normuon",
     "optim.rules.muonplus", "optim.rules.aurora", "optim.rules.meq_shape", "optim.rules.muon_vs", "optim.rules.muonh"],
    ["optim.rules"],
    ["optim.cuda_graph"],  # cuda_graph=True: the captured step (the engine hands its step over)
    ["optim.decision", "optim.entry"],  # the step's one decision: taken or skipped (non-finite gradients, a scaler,
    # an error); one parameter as the step sees it
    ["optim.engine", "optim.memory"],
    ["optim.presets", "optim.presets_2026"],  # the 2026 field's presets subclass presets' (issue 48)
    ["optim.registry"],
    ["optim.factory"],
    ["optim"],
]


def modules(folder: Path) -> dict[str, Path]:
    """Dotted name (relative to the package) -> file, for every ``.py`` under ``folder``."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(ROOT / PACKAGE).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, str]]:
    """``(imported module, line, how)`` for each package module ``name`` imports; ``how`` is ``"module"``,
    ``"function"`` (inside a def) or ``"typing"`` (under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            h = how
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                h = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                h = "typing"
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith(PACKAGE + "."):
                        target = a.name[len(PACKAGE) + 1:]
                        found.append((target, child.lineno, h))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    mod = ".".join([*anchor, *(child.module.split(".") if child.module else [])])
                elif child.module and child.module.startswith(PACKAGE + "."):
                    mod = child.module[len(PACKAGE) + 1:]
                elif child.module == PACKAGE:
                    mod = ""
                else:
                    continue
                for a in child.names:
                    sub = f"{mod}.{a.name}" if mod else a.name
                    found.append((sub if sub in known else mod, child.lineno, h))
            visit(child, h)

    visit(tree, "module")
    return [(t, line, h) for t, line, h in found if t in known and t != name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def report(folder: str = "optim") -> dict[str, list]:
    """The import graph of ``meqmuon/<folder>`` (and what it imports of the package): its cycles, upward
    imports, lazy imports and modules in no layer."""
    known = modules(ROOT / PACKAGE)
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    scope = [m for m in known if m == folder or m.startswith(folder + ".")]
    edges = {m: imports(m, known[m], set(known)) for m in scope}
    graph = {m: {t for t, _, _ in e if t in scope} for m, e in edges.items()}
    upward, lazy = [], []
    for m, e in edges.items():
        for t, line, how in e:
            if how != "module":
                lazy.append(f"{m}:{line} imports {t} ({how})")
            if m in layer and t in layer and layer[t] > layer[m]:
                upward.append(f"{m}:{line} imports {t} (layer {layer[m]} -> {layer[t]})")
            elif t not in layer and t.split(".")[0] in ("train", "cli", "diagnostics", "__main__"):
                upward.append(f"{m}:{line} imports {t} (out of the core: cli -> train -> optim -> functional)")
    unplaced = sorted({m for m in scope if m not in layer} | {t for e in edges.values() for t, _, _ in e
                                                              if t not in layer and t.split(".")[0] not in
                                                              ("train", "cli", "diagnostics", "__main__")})
    return {"cycles": cycles(graph), "upward": upward, "lazy": lazy, "unplaced": unplaced,
            "edges": [f"{m} -> {t}" for m, e in edges.items() for t, _, _ in e]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", action="store_true", help="print every import edge")
    args = ap.parse_args()
    r = report()
    if args.graph:
        print("\n".join(r["edges"]))
    for cyc in r["cycles"]:
        print("cycle:", " <-> ".join(cyc))
    for line in r["upward"]:
        print("upward:", line)
    for line in r["lazy"]:
        print("lazy:", line)
    for m in r["unplaced"]:
        print("in no layer:", m)
    print(f"meqmuon/optim: {len(r['cycles'])} cycles, {len(r['upward'])} upward imports, "
          f"{len(r['lazy'])} imports inside functions or TYPE_CHECKING, {len(r['unplaced'])} modules in no layer")
    return 0 if not (r["cycles"] or r["upward"] or r["unplaced"]) else 1


if __name__ == "__main__":
    sys.exit(main())
