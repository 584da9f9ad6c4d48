# ruff: noqa
# Vendored from tilde-research/aurora-release at 3d79a5c75c055e7e83cdd9dfa500ea37f41cc8cb, src/polar.py, under its
# MIT license (below). Changes, for the float64 equality test only: the compute dtype `G.bfloat16()` -> `G.to(DTYPE)`, DTYPE float64.
#
# MIT License
#
# Copyright (c) 2026 Tilde Research
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.

"""Polar factor via simple-quintic Newton-Schulz.

For a matrix G with SVD G = U Σ V^T, this returns U V^T (the polar factor
of G). All non-zero singular values are mapped to 1.

Implementation: 12 iterations of the simple-quintic polynomial
    p(σ) = 2σ - 1.5σ³ + 0.5σ⁵
which has fixed points at σ ∈ {0, 1, √2}, with σ=1 super-attracting
(p'(1) = 0). After 12 iterations of cubic-rate convergence, all input
singular values in (0, √2) are driven to 1 to bf16 precision.

This is the polar method used by the Modded-NanoGPT track-3 baseline at
https://github.com/KellerJordan/modded-nanogpt/blob/master/records/track_3_optimization/train_gpt_simple.py
"not optimizing for wallclock speed". We match it byte-for-byte so that
optimizers built on this `polar` reproduce leaderboard val_loss curves.
"""

import torch

#: The compute dtype (upstream: bfloat16).
DTYPE = torch.float64


@torch.no_grad()
def polar(G: torch.Tensor) -> torch.Tensor:
    """Polar factor via 12-step simple-quintic Newton-Schulz.

    Args:
        G: input matrix of shape [..., m, n].

    Returns:
        polar(G) of the same shape, in bfloat16. All non-zero singular values
        of G are mapped to 1.
    """
    assert G.ndim >= 2
    X = G.to(DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT

    # Ensure spectral norm <= 1 so the iteration converges to polar.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    # Simple-quintic coefficients: p(σ) = aσ + bσ³ + cσ⁵ with σ=1 super-attracting.
    a, b, c = 2, -1.5, 0.5
    for _ in range(12):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X

    if G.size(-2) > G.size(-1):
        X = X.mT
    return X
