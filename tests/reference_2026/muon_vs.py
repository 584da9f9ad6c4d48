# ruff: noqa
# (Line ends: upstream CRLF, here LF.)
# Vendored excerpt of jingru-lee/Variance-Adaptive-Muon at 75f78ad7dd56133c01696c9298fdc5f08182dbe0,
# NanoGPT/gpt2/models/optimizers/muon_vs.py, under its MIT license (below): zeropower_via_newtonschulz5
# (lines 1-43) and the single-parameter body of Muon_VS.step (lines 157-160, 177-238 and update_prev's
# 166-169), as one function for one process. Changes, for the float64 equality test only: the compute dtype
# `G.bfloat16()` -> `G.to(DTYPE)` (DTYPE float64), the bf16 update buffer (`g.to(update_buffer.dtype)`) and
# the all-gather left out; `self.adjust_lr_for_muon` inlined (its two lines, 126-128).
#
# MIT License
#
# Copyright (c) 2026 jingruLee
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

import math
import torch
from torch import Tensor

#: The compute dtype (upstream: bfloat16).
DTYPE = torch.float64


def zeropower_via_newtonschulz5(G: Tensor, steps: int) -> Tensor:
    """
    Newton-Schulz iteration for computing the orthogonalization (zeroth power) of matrix G.
    
    This implementation uses a quintic iteration with coefficients optimized to maximize 
    the slope at zero. The iteration produces an approximation US'V^T where S' is diagonal 
    with S_{ii}' approximately uniformly distributed in [0.5, 1.5], which empirically shows 
    minimal performance degradation compared to exact SVD orthogonalization UV^T.
    
    Args:
        G: Input tensor of shape (..., M, N) where M, N are matrix dimensions.
        steps: Number of Newton-Schulz iterations to perform.
        
    Returns:
        Orthogonalized tensor of the same shape as input G.
        
    Reference:
        Adapted from https://github.com/KellerJordan/Muon
    """
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT

    # Normalize spectral norm to at most 1 for numerical stability
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    
    # Perform quintic Newton-Schulz iterations
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_vs_step(p, g, state, group):
    """One Muon_VS step of one parameter ``p`` with gradient ``g`` (upstream's loop body, one process)."""
    eps = group["eps"]
    momentum = group["momentum"]
    lr = group["lr"]
    # Precompute constants for computational efficiency
    one_minus_momentum = 1 - momentum
    nesterov_factor = momentum / one_minus_momentum
    variance_factor = momentum * one_minus_momentum
    
    # Store original shape for learning rate adjustment
    original_shape = p.shape

    # Reshape high-dimensional tensors (e.g., conv filters) to 2D
    if g.ndim == 4:
        g = g.view(g.size(0), -1)
    elif g.ndim > 2:
        g = g.view(g.size(0), -1)

    # Initialize state buffers on first iteration
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(g)
        state["variance_buffer"] = torch.zeros_like(g)
        state["step"] = 0  # Step counter for bias correction

    # Retrieve state buffers
    M = state["momentum_buffer"]
    V = state["variance_buffer"]
    
    # Increment step counter
    state["step"] += 1
    step = state["step"]
    
    # Step 1: Update momentum (M) and variance (V) estimates
    # V_t = β*V_{t-1} + β*(1-β)*(M_{t-1} - G_t)^2
    # This captures the variance of gradient prediction errors
    V.mul_(momentum).addcmul_(M - g, M - g, value=variance_factor)
    # M_t = β*M_{t-1} + (1-β)*G_t
    M.mul_(momentum).add_(g, alpha=one_minus_momentum)

    # Step 2: Compute bias correction factors
    # First moment M: update weight is (1-β), bias correction factor is (1 - β^t)
    # Second moment V: update weight is β(1-β), bias correction factor is β(1 - β^t)
    bias_correction_M = 1 - momentum ** step
    bias_correction_V = 1 - momentum ** step
    
    # Step 3: Apply bias correction to denoise estimates
    M_corrected = M / bias_correction_M
    V_corrected = V / bias_correction_V

    # Step 4: Compute Nesterov-accelerated momentum
    # M_hat = (β/(1-β)) * M_corrected + G_t
    M_hat = M_corrected * nesterov_factor + g
    
    # Step 5: Variance-stabilized preprocessing
    # M_tilde = M_hat / sqrt(V_corrected + eps)
    # This normalization prevents extreme magnitude variations
    M_tilde_snr = M_hat / (V_corrected).sqrt().add_(eps)

    # Step 6: Orthogonalize via Newton-Schulz iteration
    # O_t = NS5(M_tilde)
    O = zeropower_via_newtonschulz5(M_tilde_snr, steps=group["ns_steps"])
    
    # Step 7: Adjust learning rate based on parameter shape
    # Uses fixed scaling based on parameter dimensions rather than dynamic norm-based scaling
    A, B = original_shape[:2]
    adjusted_lr = math.sqrt(max(A, B)) * 0.2
    
    # Apply scaled orthogonalized update
    g = O.flatten()
    g = g * adjusted_lr  # Scale by adjusted learning rate ratio
    p_world, g_world = p, g
    # Apply weight decay (L2 regularization)
    p_world.mul_(1 - group["lr"] * group["weight_decay"])
    # Apply orthogonalized gradient update
    p_world.add_(g_world.view_as(p_world), alpha=-group["lr"])
