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
