"""Row/column imbalance of Muon's updates and of embedding/head momentum (paper section 3.1, Tables 1, 3, 4, 8-10).

For a matrix ``X`` (m x n) the statistics are the CVs of its row and column RMS vectors (eq. 4-5)::

    r_i = ||X_i,:||_2 / sqrt(n),   c_j = ||X_:,j||_2 / sqrt(m),
    gamma = std(v_+) / mean(v_+)   over the entries above 1e-7 (population std).

Hidden matrices: the captured pre-NS matrix ``M`` gives Muon's update ``U = Orth(M)`` with 5 quintic
NS steps (eq. 3; bf16 like the optimizer unless told otherwise); "after" is MeqMuon's adaptive
one-sided normalisation of ``U`` (eq. 8). Embedding and head: the captured momentum ``B`` itself
(Table 3); "after" is the two-sided ``N_c(N_r(B))`` (eq. 9).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..functional import NS_COEFFICIENTS, NS_STEPS, adaptive_normalize, equilibrate, orthogonalize, row_col_cv
from .capture import layer_index, module_type
from .tables import fmt_cv, fmt_pair, markdown_table, shape_str

__all__ = [
    "MODULE_ORDER",
    "module_sort_key",
    "matrix_stats",
    "imbalance_records",
    "hidden_cv_table",
    "momentum_cv_table",
    "normalization_table",
]

#: Row order of the paper's tables (Llama/Qwen2 module names); others follow alphabetically.
MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_sort_key(name: str) -> tuple[int, int, str]:
    """Sort parameter names by layer, then in the paper's module order."""
    layer = layer_index(name)
    mod = module_type(name)
    rank = MODULE_ORDER.index(mod) if mod in MODULE_ORDER else len(MODULE_ORDER)
    return (-1 if layer is None else layer, rank, mod)


def _cvs(x: torch.Tensor) -> tuple[float, float]:
    gr, gc = row_col_cv(x)
    return float(gr), float(gc)


def matrix_stats(
    x: torch.Tensor,
    kind: str,
    *,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype | None = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
) -> dict[str, Any]:
    """Before/after CVs of one captured matrix.

    Args:
        x: pre-NS matrix (``kind == "hidden"``) or momentum (embedding/head).
        kind: parameter kind; hidden matrices are orthogonalised first.
        ns_steps, ns_dtype, coefficients: Newton-Schulz settings for hidden matrices.

    Returns:
        dict with ``before = (gamma_r, gamma_c)`` of ``U = Orth(x)`` (hidden) or of ``x`` (others),
        ``after`` = the CVs after MeqMuon's normalisation, and for hidden matrices ``chose_rows``.
    """
    out: dict[str, Any] = {"shape": tuple(x.shape), "kind": kind}
    if kind == "hidden":
        u = orthogonalize(x, ns_steps, coefficients, ns_dtype)
        out["before"] = _cvs(u)
        normed, chose_rows = adaptive_normalize(u)
        out["after"] = _cvs(normed)
        out["chose_rows"] = bool(chose_rows)
    else:
        out["before"] = _cvs(x)
        out["after"] = _cvs(equilibrate(x))
    return out


def imbalance_records(
    captures: Mapping[int, Mapping[str, Any]],
    layers: Iterable[int] | None = None,
    **ns: Any,
) -> list[dict[str, Any]]:
    """One record per (step, captured matrix): ``step, name, layer, module, kind, shape, before, after``.

    ``layers`` filters hidden matrices (embedding/head are always kept); ``ns`` goes to
    :func:`matrix_stats`. Records are ordered by step, then layer and the paper's module order.
    """
    wanted = None if layers is None else {int(i) for i in layers}
    records = []
    for step in sorted(captures):
        cap = captures[step]
        for name in sorted(cap["tensors"], key=module_sort_key):
            kind = cap["kinds"][name]
            if kind not in ("hidden", "embedding", "head"):
                continue
            layer = layer_index(name)
            if kind == "hidden" and wanted is not None and layer not in wanted:
                continue
            rec = matrix_stats(cap["tensors"][name], kind, **ns)
            rec.update(step=step, name=name, layer=layer, module=module_type(name))
            records.append(rec)
    return records


def _by_matrix(records: Iterable[Mapping[str, Any]], kinds: tuple[str, ...]) -> tuple[list[int], dict[str, dict]]:
    steps: list[int] = []
    rows: dict[str, dict] = {}
    for r in records:
        if r["kind"] not in kinds:
            continue
        if r["step"] not in steps:
            steps.append(r["step"])
        rows.setdefault(r["name"], {"rec": r, "by_step": {}})["by_step"][r["step"]] = r
    return sorted(steps), rows


def hidden_cv_table(records: Iterable[Mapping[str, Any]], which: str = "before") -> str:
    """Tables 1 and 8-10: rows layer x matrix (with shape), a ``gamma_r | gamma_c`` pair per step.

    The larger CV of each pair is bold. ``which="after"`` tabulates the normalised updates instead.
    """
    steps, rows = _by_matrix(records, ("hidden",))
    header = ["Layer", "Matrix", "Shape"]
    for s in steps:
        header += [f"step {s} γ_r", f"step {s} γ_c"]
    body = []
    for name in sorted(rows, key=module_sort_key):
        rec = rows[name]["rec"]
        cells = [str(rec["layer"]), f"`{rec['module']}`", shape_str(rec["shape"])]
        for s in steps:
            r = rows[name]["by_step"].get(s)
            cells += list(fmt_pair(*r[which])) if r else ["", ""]
        body.append(cells)
    return markdown_table(header, body, "llr" + "r" * (2 * len(steps)))


def momentum_cv_table(records: Iterable[Mapping[str, Any]]) -> str:
    """Table 3: CVs of the unorthogonalised embedding/head momentum, a pair per step."""
    steps, rows = _by_matrix(records, ("embedding", "head"))
    header = ["Matrix", "Shape"]
    for s in steps:
        header += [f"step {s} γ_r", f"step {s} γ_c"]
    body = []
    for name in sorted(rows, key=module_sort_key):
        rec = rows[name]["rec"]
        cells = [f"`{rec['module']}`", shape_str(rec["shape"])]
        for s in steps:
            r = rows[name]["by_step"].get(s)
            cells += list(fmt_pair(*r["before"])) if r else ["", ""]
        body.append(cells)
    return markdown_table(header, body)


def normalization_table(records: Iterable[Mapping[str, Any]], step: int) -> str:
    """Table 4 for one step: CVs before and after MeqMuon's normalisation, hidden then embedding/head."""
    sel = [r for r in records if r["step"] == step]
    hidden = sorted((r for r in sel if r["kind"] == "hidden"), key=lambda r: module_sort_key(r["name"]))
    other = sorted((r for r in sel if r["kind"] != "hidden"), key=lambda r: module_sort_key(r["name"]))
    header = ["Layer", "Matrix", "Shape", "Before γ_r", "Before γ_c", "After γ_r", "After γ_c", "MeqMuon side"]
    body = []
    for r in hidden + other:
        side = ("rows" if r["chose_rows"] else "columns") if r["kind"] == "hidden" else "rows, then columns"
        body.append(
            [
                "" if r["layer"] is None else str(r["layer"]),
                f"`{r['module']}`",
                shape_str(r["shape"]),
                *(fmt_cv(v) for v in r["before"]),
                *(fmt_cv(v) for v in r["after"]),
                side,
            ]
        )
    return markdown_table(header, body, "llrrrrrl")
