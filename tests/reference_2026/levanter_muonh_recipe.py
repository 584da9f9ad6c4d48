"""MuonH's whole recipe as levanter builds it after marin PR 2545 (merged 2026-01-29), transcribed from JAX to torch
for one process and plain 2-D / 1-D tensors (no layer stacking, no sharding). Copyright The Levanter Authors and
Google DeepMind (optax), SPDX-License-Identifier: Apache-2.0. Sources (marin-community/marin unless said):

* ``lib/levanter/src/levanter/optim/muonh.py`` at ab6e485c6250984825d2ecbb983b3c02e247e062 (``MuonHConfig``:
  ``adam_lr`` 6e-4, ``momentum`` 0.95, ``beta1`` 0.9, ``beta2`` 0.95, ``epsilon`` 1e-8, ``muon_epsilon`` 1e-8,
  ``max_grad_norm`` 1.0, ``tangent_projection`` False; ``build``'s three branches; ``create_mask``: "Embedding" ->
  adam, "lm_head" -> adamh, linear weights -> muonh, anything else -> adam; ``scale_with_muonh``). PR 2545 changed
  only where its Newton-Schulz comes from: ``levanter.optim.util.zeropower_via_newtonschulz5`` with the default
  ``coefficient_type="quintic"`` (the PR's description; the post-PR muonh.py itself is not in the stored copies
  this was written from, the marin snapshot being over the fetch limit).
* ``lib/levanter/src/levanter/optim/util.py`` at 054a715f24ae9c2ba9c8bdf30d9a094e7c8f2e0f
  (``NEWTON_SCHULZ_COEFFICIENTS``, ``zeropower_via_newtonschulz5``: ``X /= norm(X) + eps``, ``coeffs[i % len]``).
* ``lib/levanter/src/levanter/optim/adamh.py`` at 00843426942b191a6a4ccc10a399cb8aee4249c1 (``scale_by_adamh``).
* google-deepmind/optax at 2edbcbe2390da13983b92cbef94ac0460ecde1c5: ``optax/_src/transform.py``
  (``scale_by_adam``, eps_root 0), ``optax/tree_utils/_tree_math.py`` (``tree_update_moment``,
  ``tree_update_moment_per_elem_norm``, ``tree_bias_correction``), ``optax/transforms/_clipping.py``
  (``clip_by_global_norm``: ``t`` if ``||g|| < max_norm`` else ``(t / ||g||) * max_norm``).

Changes: torch for jax.numpy, in the inputs' dtype (float64 in the test); the optax tree plumbing, ``multi_transform``
and ``inject_hyperparams`` written as the loop over the three labelled sets they amount to; the schedule left out
(constant ``learning_rate`` and ``adam_lr`` per step).
"""

import torch

#: util.py's NEWTON_SCHULZ_COEFFICIENTS["quintic"] (from NVIDIA-NeMo Emerging-Optimizers).
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def zeropower_via_newtonschulz5(X, steps=5, eps=1e-7, coeffs=QUINTIC):
    X = X / (torch.linalg.norm(X) + eps)  # Ensure top singular value <= 1
    transpose = False
    if X.shape[0] > X.shape[1]:
        X = X.T
        transpose = True
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transpose:
        X = X.T
    return X


def clip_by_global_norm(grads, max_norm):
    g_norm = torch.sqrt(sum((g * g).sum() for g in grads))
    if g_norm < max_norm:
        return list(grads)
    return [(g / g_norm) * max_norm for g in grads]


def _sphere(p, u, learning_rate):
    """``scale_invariant_update`` (2-D case) applied: the new parameter."""
    new_p = p - learning_rate * u * torch.linalg.norm(p) / torch.clamp(torch.linalg.norm(u), min=1e-10)
    return p + (new_p / torch.linalg.norm(new_p) * torch.linalg.norm(p) - p)


class MuonHRecipe:
    """The three branches over named tensors: ``kinds[name]`` is "muonh", "adamh" or "adam"."""

    def __init__(self, kinds, learning_rate, adam_lr=6e-4, momentum=0.95, nesterov=True, steps=5, beta1=0.9,
                 beta2=0.95, epsilon=1e-8, muon_epsilon=1e-8, max_grad_norm=1.0, coeffs=QUINTIC):
        self.kinds, self.lr, self.adam_lr = kinds, learning_rate, adam_lr
        self.momentum, self.nesterov, self.steps, self.coeffs = momentum, nesterov, steps, coeffs
        self.b1, self.b2, self.eps = beta1, beta2, epsilon
        self.muon_eps, self.max_grad_norm = muon_epsilon, max_grad_norm
        self.buf, self.mu, self.nu, self.count = {}, {}, {}, {"adamh": 0, "adam": 0}

    def _adam_direction(self, name, g, count):
        mu = (1 - self.b1) * g + self.b1 * self.mu.get(name, torch.zeros_like(g))
        nu = (1 - self.b2) * g**2 + self.b2 * self.nu.get(name, torch.zeros_like(g))
        self.mu[name], self.nu[name] = mu, nu
        mu_hat = mu / (1 - self.b1**count)
        nu_hat = nu / (1 - self.b2**count)
        return mu_hat / (torch.sqrt(nu_hat + 0.0) + self.eps)

    def step(self, params, grads):
        """``params``, ``grads``: name -> tensor; returns the new parameters."""
        out = {}
        for label in ("muonh", "adamh", "adam"):
            names = [n for n in params if self.kinds[n] == label]
            if not names:
                continue
            gs = [grads[n] for n in names]
            if self.max_grad_norm:
                gs = clip_by_global_norm(gs, self.max_grad_norm)
            if label != "muonh":
                self.count[label] += 1
            for n, g in zip(names, gs, strict=True):
                p = params[n]
                if label == "muonh":
                    buf = self.momentum * self.buf.get(n, torch.zeros_like(g)) + g
                    self.buf[n] = buf
                    u = self.momentum * buf + g if self.nesterov else buf
                    u = zeropower_via_newtonschulz5(u, steps=self.steps, eps=self.muon_eps, coeffs=self.coeffs)
                    out[n] = _sphere(p, u, self.lr)
                elif label == "adamh":
                    out[n] = _sphere(p, self._adam_direction(n, g, self.count[label]), self.lr)
                else:  # optax.scale_by_adam, then optax.scale(-adam_lr)
                    out[n] = p + (-self.adam_lr) * self._adam_direction(n, g, self.count[label])
        return out
