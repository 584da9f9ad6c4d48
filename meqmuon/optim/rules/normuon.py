"""NorMuon for hidden matrices (zichongli5/NorMuon d45c9a4; Li et al. 2025): per-tensor and batched forms,
both through :func:`normuon_normalize`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import functional as F
from ..distributed import local, state_like
from ..step import HiddenRule, MomentumRule, apply_update, buffer, shape_scale

# NorMuon's epsilons (zichongli5/NorMuon d45c9a4, normuon.py): 1e-10 in the row scaling and in the
# Frobenius-norm restore.
NORMUON_EPS = 1e-10


def normuon_normalize(O: Tensor, v: Tensor, beta2: float, psum: F.PSum = None, work: Tensor | None = None) -> Tensor:
    """NorMuon's normalisation of ``O = Orth(B)``, a matrix ``(m, n)`` or a stack ``(k, m, n)``: ``v``
    (``(m,)`` or ``(k, m)``, O's dtype) takes the row second moments in place; returns ``O'``
    (into ``work`` if given). With ``psum`` (row shards) the Frobenius norms sum over shards."""
    v.lerp_(torch.mul(O, O, out=work).mean(dim=-1), 1.0 - beta2)
    scaled = torch.div(O, v.sqrt().unsqueeze(-1) + NORMUON_EPS, out=work)
    dims = (-2, -1)
    if psum is None:
        fro_o, fro_s = torch.linalg.vector_norm(O, dim=dims), torch.linalg.vector_norm(scaled, dim=dims)
    else:  # Frobenius norms of whole matrices: sum the shards' sums of squares
        sq = psum(torch.stack([O.square().sum(dim=dims), scaled.square().sum(dim=dims)]))
        fro_o, fro_s = sq[0].sqrt(), sq[1].sqrt()
    return scaled.mul_((fro_o / (fro_s + NORMUON_EPS))[..., None, None])


class NorMuonHidden(HiddenRule):
    """NorMuon for hidden matrices (zichongli5/NorMuon d45c9a4 ``normuon_update``; Li et al. 2025).

    ``O = Orth(B)``; per-row second moment ``v <- lerp(v, mean_j O_ij^2, 1 - beta2)`` (no bias
    correction, as upstream; it would be a global scalar that the restore below cancels);
    ``O' = O / (sqrt(v) + 1e-10)``; ``O' <- O' * ||O||_F / (||O'||_F + 1e-10)``; scale
    ``rho * sqrt(max(m, n))`` (dion's "rms_norm" adjust_lr, so NorMuon shares Muon's lr grid;
    upstream's single file uses ``sqrt(max(1, m/n))`` with a 10-20x larger lr instead).

    Deliberate deviation: ``v`` and the normalisation are at least float32 whatever the parameter dtype,
    avoiding the upstream bf16/fp32 ``lerp`` dtype failure (zichongli5/NorMuon issue 7, PR 10).
    """

    name = "normuon_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "beta2", "ns_steps", "ns_coefficients", "ns_dtype")
    owner_state = ("second_moment",)
    state_views = {**MomentumRule.state_views, "second_moment": "rows"}

    def state_elements(self, layout):
        return super().state_elements(layout) + math.prod(layout.rows_shape)

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        state["second_moment"] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32))

    def update(self, items, group, ctx):
        beta2 = group["beta2"]
        psum = ctx.split.psum
        scratch: dict[tuple, Tensor] = {}  # reused by same-shape matrices: no fresh temporaries
        for i, O in self.orthogonalized(items, group, ctx):
            it = items[i]
            dtype = torch.promote_types(O.dtype, torch.float32)
            if O.dtype != dtype:
                O = buffer(scratch, "O", O.shape, dtype, O.device).copy_(O)
            work = buffer(scratch, "work", O.shape, dtype, O.device)
            # Rows are whole on every shard, so the per-row second moment is local under FSDP2.
            state_v = local(it.state["second_moment"])
            v = state_v.to(O.dtype)
            scaled = normuon_normalize(O, v, beta2, psum, work)
            state_v.copy_(v)
            apply_update([it], [scaled], [group["rho"] * shape_scale(it.shape)], group)

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Per bucket: one batched NS, then the per-row second moments of all members as one
        ``(k, m)`` stack (rows are original rows: NorMuon buckets never transpose)."""
        beta2, psum = group["beta2"], ctx.split.psum
        out = []
        for b, (lo, hi), O in zip(buckets, ranges, self.orthogonalized_stacks(buckets, ranges, group, ctx),
                                  strict=True):
            O = O.to(torch.promote_types(O.dtype, torch.float32))
            v = torch.stack([local(it.state["second_moment"]) for it in b.items[lo:hi]]).to(O.dtype)
            scaled = normuon_normalize(O, v, beta2, psum)
            out.append((scaled, [v]))
        return out

    def scale_foreach(self, bucket, group):
        return group["rho"] * shape_scale(bucket.global_shape)

    def owner_stacks(self, bucket):
        return [local(bucket.items[0].state["second_moment"])[None]]

    def store_foreach(self, buckets, extras):
        states = [local(it.state["second_moment"]) for b in buckets for it in b.items]
        torch._foreach_copy_(states, [row for (v,) in extras for row in v.unbind(0)])


