"""``meqmuon-shape``: MeqMuon's hidden rule with the row/column choice of eq. 8 fixed by the matrix's shape,
an ablation of the data-dependent choice (issue 48)."""

from __future__ import annotations

from ... import functional as F
from ..driver import HiddenRule


class MeqShapeHidden(HiddenRule):
    """``D = rho N_r(Orth(X))`` for tall and square matrices (``m >= n``), ``rho N_c(Orth(X))`` for wide ones.

    ``N_r``, ``N_c``: every nonzero row / column to unit RMS (paper eq. 7; RMS <= 1e-7 counts as zero and
    stays zero), as :class:`~meqmuon.optim.rules.meqmuon.MeqHidden`'s; only the choice differs. Tall picks
    rows and wide picks columns, the side orthogonalisation leaves free and the side MeqMuon's CV picks on
    96-100 % of steps (paper Table 6: gate/up rows, down and SmolLM2's wide k/v columns). Square picks rows:
    MeqMuon's own tie-break, and the majority of the paper's square modules (Llama-350M q, k, v: rows on
    90-99.7 % of steps; o: columns on 90 %). The choice is a Python ``if`` on the static shape: no sync.
    Each orientation of a shared stack is its own shape here (``post`` sees it as itself)."""

    name = "meq_shape_hidden"

    def post(self, U, group):
        m, n = U.shape[-2:]
        D = F.row_normalize(U) if m >= n else F.col_normalize(U)
        return D.mul_(group["rho"])
