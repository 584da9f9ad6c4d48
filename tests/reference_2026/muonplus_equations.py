"""Muon+'s update for one 2-D parameter, written from its equations, not copied: K1seki221/MuonPlus at
8a9ace123afedaab8ba75ea0b19315594ae1da7c has no license file, so its code is not vendored here. The equations,
as ``utils/optim/muon_plus.py`` computes them (``MuonPlus.step``, ``apply_post_polar_norm``,
``zeropower_via_newtonschulz5``, ``adjust_lr_for_muon`` with ``rms_scaling=True``, ``nuclear_scaling=False``)::

    buf <- mu buf + G;  X = G + mu buf (Nesterov) else buf
    U = NS5(X): Keller Jordan's quintic (3.4445, -4.7750, 2.0315), X / (||X||_F + 1e-7), on the wide side
    row:  U_ij <- U_ij / sqrt(sum_j U_ij^2 + 1e-7);  col: the same over i; row_col: row then col; col_row: col then row
    W <- (1 - lr wd) W;  W <- W - lr sqrt(m / n) U
"""

import math

import torch


def ns5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.mT if G.shape[0] > G.shape[1] else G
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.shape[0] > G.shape[1] else X


def normalize(U, mode):
    sides = [] if mode == "none" else mode.split("_")
    for side in sides:
        U = U / torch.sqrt((U * U).sum(dim=-1 if side == "row" else -2, keepdim=True) + 1e-7)
    return U


def muonplus_step(W, G, buf, lr, wd, mode, momentum=0.95, nesterov=True, steps=5):
    """One step in place on ``W`` and ``buf``."""
    buf.mul_(momentum).add_(G)
    X = G + momentum * buf if nesterov else buf
    U = normalize(ns5(X, steps), mode)
    W.mul_(1 - lr * wd).add_(U, alpha=-lr * math.sqrt(W.shape[0] / W.shape[1]))


# ---- the recipe's other kinds (issue 58) --------------------------------------------------------------------------
# ``MuonPlus.step``'s AdamW branch (every parameter that is not a >= 2-D body matrix: names containing "embeddings",
# "embed_tokens", "wte", "lm_head", "wpe", and every 1-D one), with ``utils/optim/utils.py``'s ``get_optimizer``
# defaults (``adamw_betas`` = the config's ``betas`` or (0.95, 0.95), ``adamw_eps`` 1e-8) and one ``weight_decay``
# for every parameter (``configs/llama60M_row-col.yaml``: 0.05); ``utils/train_distributed.py`` calls
# ``torch.nn.utils.clip_grad_norm_(model.parameters(), training_params["gradnorm"])`` (1.0) before each step::
#
#     t <- t + 1;  m <- lerp(m, G, 1 - beta1);  v <- lerp(v, G^2, 1 - beta2)
#     W <- (1 - lr wd) W;  W <- W - lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (eps + sqrt(v))


def adamw_step(W, G, state, lr, wd, betas=(0.95, 0.95), eps=1e-8):
    """One step of Muon+'s AdamW branch in place on ``W`` (``state``: ``step``, ``moment1``, ``moment2``)."""
    beta1, beta2 = betas
    if "step" not in state:
        state["step"] = 0
        state["moment1"] = torch.zeros_like(G)
        state["moment2"] = torch.zeros_like(G)
    state["step"] += 1
    t = state["step"]
    state["moment1"].lerp_(G, 1 - beta1)
    state["moment2"].lerp_(G.square(), 1 - beta2)
    g = state["moment1"] / (eps + state["moment2"].sqrt())
    scale = (1 - beta1**t) / (1 - beta2**t) ** 0.5
    W.mul_(1 - lr * wd)
    W.add_(g, alpha=-lr / scale)
