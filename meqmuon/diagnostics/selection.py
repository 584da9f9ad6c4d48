"""Which side MeqMuon normalises, by module type (paper section 4, Table 6).

MeqMuon picks ``N_r(U)`` when ``gamma_r(U) >= gamma_c(U)`` and ``N_c(U)`` otherwise (eq. 8), per
matrix and step; the optimizer counts the row choices (``opt.selection_counts()``), and the run
directory keeps them as ``selection_counts.json``. This module aggregates them over layers and
steps per module type (the last module component of the name: ``q_proj``, ..., ``down_proj``)::

    Row (%) = 100 * sum_layers rows / sum_layers (rows + cols),   Col (%) = 100 - Row (%).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .capture import module_type
from .imbalance import MODULE_ORDER
from .tables import bold, markdown_table, shape_str

__all__ = ["read_selection_counts", "selection_shares", "selection_table"]


def read_selection_counts(path: str | Path) -> dict[str, tuple[int, int]]:
    """Read ``selection_counts.json``: ``{name: [rows, cols]}`` or ``{name: {"rows": r, "cols": c}}``.

    A top-level ``{"counts": {...}}`` wrapper is accepted too. Returns name -> (rows, cols).
    """
    data = json.loads(Path(path).read_text())
    if isinstance(data, Mapping) and "counts" in data and isinstance(data["counts"], Mapping):
        data = data["counts"]
    out: dict[str, tuple[int, int]] = {}
    for name, v in data.items():
        if isinstance(v, Mapping):
            r = v.get("rows", v.get("row"))
            c = v.get("cols", v.get("columns", v.get("col")))
        else:
            r, c = v
        out[name] = (int(r), int(c))
    return out


def selection_shares(
    counts: Mapping[str, tuple[int, int]], shapes: Mapping[str, tuple[int, ...]] | None = None
) -> list[dict[str, Any]]:
    """Aggregate per module type: ``module, shapes, rows, cols, matrices, row_pct, col_pct``.

    Ordered as the paper (q, k, v, o, gate, up, down), other modules after, alphabetically.
    Modules without any counted step are left out (a share of nothing is undefined).
    """
    agg: dict[str, dict[str, Any]] = {}
    for name, (r, c) in counts.items():
        mod = module_type(name)
        a = agg.setdefault(mod, {"module": mod, "rows": 0, "cols": 0, "matrices": 0, "shapes": []})
        a["rows"] += int(r)
        a["cols"] += int(c)
        a["matrices"] += 1
        if shapes and name in shapes:
            s = tuple(int(d) for d in shapes[name])
            if s not in a["shapes"]:
                a["shapes"].append(s)
    out = []
    for mod in sorted(agg, key=lambda m: (MODULE_ORDER.index(m) if m in MODULE_ORDER else len(MODULE_ORDER), m)):
        a = agg[mod]
        total = a["rows"] + a["cols"]
        if total == 0:
            continue
        a["row_pct"] = 100.0 * a["rows"] / total
        a["col_pct"] = 100.0 - a["row_pct"]
        out.append(a)
    return out


def selection_table(shares: list[Mapping[str, Any]]) -> str:
    """Table 6 layout: ``Module | Shape | Row (%) | Col. (%) | matrix-steps``, the larger share bold."""
    body = []
    for a in shares:
        r, c = f"{a['row_pct']:.2f}", f"{a['col_pct']:.2f}"
        r, c = (bold(r), c) if a["row_pct"] >= a["col_pct"] else (r, bold(c))
        shape = ", ".join(shape_str(s) for s in a["shapes"]) or "?"
        body.append([f"`{a['module']}`", shape, r, c, str(a["rows"] + a["cols"])])
    return markdown_table(["Module", "Shape", "Row (%)", "Col. (%)", "matrix-steps"], body, "lrrrr")
