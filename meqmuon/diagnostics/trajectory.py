"""Row/column CVs along the Newton-Schulz iteration (paper section 3.1, Figure 1).

Replays the quintic iteration of eq. 3 from a saved pre-NS matrix ``M``::

    X_0 = M / ||M||_F,   A_k = X_k X_k^T,   X_{k+1} = a X_k + (b A_k + c A_k^2) X_k

and records ``(gamma_r(X_k), gamma_c(X_k))`` for k = 0..K (eq. 4-5). The iteration runs on the wide
orientation exactly as :func:`meqmuon.functional.orthogonalize`, so ``X_k`` equals
``orthogonalize(M, k)`` bit for bit. The reference is exact orthogonalisation, the polar factor
``Y = P Q^T`` of ``M = P S Q^T`` (float64 SVD): for m > n, ``Y^T Y = I`` forces ``gamma_c = 0``; for
m < n, ``gamma_r = 0``; the other side stays free, which is why one-sided imbalance persists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..functional import NS_COEFFICIENTS, NS_EPS, ns_step, row_col_cv
from .tables import fmt_cv, markdown_table, shape_str

__all__ = ["ns_trajectory", "exact_orthogonalize", "trajectory_table", "plot_trajectories"]


def ns_trajectory(
    x: torch.Tensor,
    max_steps: int = 20,
    *,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    dtype: torch.dtype | None = torch.bfloat16,
) -> list[tuple[float, float]]:
    """``[(gamma_r, gamma_c) of X_k for k = 0..max_steps]`` for the NS iteration started at ``x``."""
    a, b, c = coefficients
    # The optimizer's own start (functional.orthogonalize): a copy in the compute dtype, normalised.
    X = x.to(dtype=dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)
    X.div_(torch.linalg.vector_norm(X).clamp(min=NS_EPS))

    def stats(y: torch.Tensor) -> tuple[float, float]:
        gr, gc = row_col_cv(y)
        return float(gr), float(gc)

    out = [stats(X)]
    for _ in range(max_steps):
        X = ns_step(X, (a, b, c))  # the optimizer's own iteration, so k = 5 reproduces its update
        out.append(stats(X))
    return out


def exact_orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """Polar factor ``P Q^T`` of ``x = P S Q^T`` in float64 (thin SVD)."""
    P, _, Qh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
    return P @ Qh


def _exact_cvs(x: torch.Tensor) -> tuple[float, float]:
    gr, gc = row_col_cv(exact_orthogonalize(x))
    return float(gr), float(gc)


def trajectories(tensors: Mapping[str, torch.Tensor], max_steps: int = 20, **kw: Any) -> dict[str, dict[str, Any]]:
    """Trajectory and exact-orthogonalisation CVs of every matrix: name -> ``{shape, traj, exact}``."""
    return {
        name: {"shape": tuple(x.shape), "traj": ns_trajectory(x, max_steps, **kw), "exact": _exact_cvs(x)}
        for name, x in tensors.items()
    }


def trajectory_table(results: Mapping[str, Mapping[str, Any]], ks: Sequence[int] = (0, 5, 20)) -> str:
    """Markdown: per matrix, ``(gamma_r, gamma_c)`` at the chosen iterations and for exact orthogonalisation."""
    from .capture import module_type

    header = ["Matrix", "Shape"]
    for k in ks:
        header += [f"k={k} γ_r", f"k={k} γ_c"]
    header += ["SVD γ_r", "SVD γ_c"]
    body = []
    for name, res in results.items():
        cells = [f"`{module_type(name)}`", shape_str(res["shape"])]
        for k in ks:
            cells += [fmt_cv(v) for v in res["traj"][k]] if k < len(res["traj"]) else ["", ""]
        cells += [fmt_cv(v) for v in res["exact"]]
        body.append(cells)
    return markdown_table(header, body)


def plot_trajectories(results: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Figure 1: one subplot per matrix, gamma_r and gamma_c against k; dashed lines: exact (SVD) values."""
    import matplotlib

    matplotlib.use("Agg")  # headless: figures are files
    import matplotlib.pyplot as plt

    from .capture import module_type

    n = len(results)
    cols = min(4, max(n, 1))
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, res) in zip(axes.flat, results.items(), strict=False):
        ks = range(len(res["traj"]))
        gr = [t[0] for t in res["traj"]]
        gc = [t[1] for t in res["traj"]]
        ax.plot(ks, gr, "o-", ms=3, color="C0", label="row CV γ_r")
        ax.plot(ks, gc, "s-", ms=3, color="C1", label="column CV γ_c")
        ax.axhline(res["exact"][0], color="C0", ls="--", lw=1, label="γ_r exact (SVD)")
        ax.axhline(res["exact"][1], color="C1", ls="--", lw=1, label="γ_c exact (SVD)")
        ax.set_title(f"{module_type(name)} ({shape_str(res['shape'])})", fontsize=9)
        ax.set_xlabel("NS iteration k")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].set_ylabel("CV")
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
