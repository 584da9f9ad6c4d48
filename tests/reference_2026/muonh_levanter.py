"""MuonH's update, transcribed line for line from JAX to torch (one 2-D parameter, no layer stacking):
marin-community/marin at ab6e485c6250984825d2ecbb983b3c02e247e062, ``lib/levanter/src/levanter/optim/muonh.py``
(``scale_with_muonh.update_fn``, ``tangent_projection=False``), and the Newton-Schulz it imports,
``levanter.optim.muon.zeropower_via_newtonschulz5`` (Keller Jordan's coefficients, ``X /= norm(X) + eps``).
Copyright 2025 The Levanter Authors, SPDX-License-Identifier: Apache-2.0. Changes: torch for jax.numpy;
the computation in the inputs' dtype (float64 in the test); the optax tree plumbing left out.
"""

import torch


def zeropower_via_newtonschulz5(X, steps=5, eps=1e-7):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = X / (torch.linalg.norm(X) + eps)  # Ensure top singular value <= 1
    transpose = False
    if X.shape[0] > X.shape[1]:
        X = X.T
        transpose = True
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transpose:
        X = X.T
    return X


def muonh_update(p, g, buf, momentum=0.95, nesterov=True, steps=5, muon_eps=1e-8, learning_rate=0.02):
    """One step: returns ``(new_p, new_buf)`` (upstream returns the update ``new_p - p`` and adds it)."""
    buf = momentum * buf + g
    updates = momentum * buf + g if nesterov else buf
    u = zeropower_via_newtonschulz5(updates, steps=steps, eps=muon_eps)
    new_p = p - learning_rate * u * torch.linalg.norm(p) / torch.clamp(torch.linalg.norm(u), min=1e-10)
    update = new_p / torch.linalg.norm(new_p) * torch.linalg.norm(p) - p
    return p + update, buf
