"""Adam-type rules: AdamW exactly as ``torch.optim.AdamW`` and SCALE's internal Adam, per-tensor
(``step``) and batched (``step_foreach``, torch's multi-tensor form) side by side."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from ... import functional as F
from ..calls import state_dtype
from ..driver import buffer, grads_like, make_buckets
from ..inputs import number
from ..rule import SteppingRule

# AdamW for the embeddings, heads and vectors of Muon and NorMuon: betas (0.9, 0.95) as the paper's runs
# (section 4) and Moonlight's toy_train.py, eps 1e-8 as torch.optim.AdamW.
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


class AdamW(SteppingRule):
    """AdamW exactly as ``torch.optim.AdamW`` (paper eq. 1-2): eps added after bias correction.

    Used for embedding/head/vector kinds by Muon, NorMuon and MuonEq. Moonlight's toy_train.py and
    MaeChd/muon-eq add eps to the uncorrected ``sqrt(v)``: an effective eps ``1/sqrt(1 - beta2^t)``
    times ours (4.47x at step 1 with beta2 0.95, within 3 % from step 56; docs/algorithm.md,
    "Baselines"). Torch's form is what the paper states (eq. 1) and lets us test parity with
    ``torch.optim.AdamW`` exactly.
    """

    name = "adamw"
    defaults = {"betas": ADAMW_BETAS, "eps": ADAMW_EPS}
    elementwise = True
    #: Moonlight/SCALE form: eps added to the uncorrected sqrt(v).
    eps_before_correction: ClassVar[bool] = False

    def validate(self, group):
        """``betas`` a pair in [0, 1), ``eps`` >= 0."""
        v = group["betas"]
        if not (isinstance(v, tuple | list) and len(v) == 2):
            raise ValueError(f"Invalid betas: {v!r} (expected a pair (beta1, beta2))")
        group["betas"] = tuple(number(f"betas[{i}]", b, low=0.0, high=1.0) for i, b in enumerate(v))
        group["eps"] = number("eps", group["eps"], low=0.0)

    def state_elements(self, layout):
        return 2 * math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        dtype = state_dtype(p, group)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def step(self, items, group, ctx):
        """In place, in ``torch.optim.AdamW``'s single-tensor order (its CPU default):
        ``W *= 1 - lr wd``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 - beta2) g^2``;
        ``W -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` as one ``addcdiv_``. The denominator goes
        into one buffer per shape, reused across the group's parameters: no parameter-sized
        temporaries (docs/benchmarks.md)."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        eps, lr, wd = group["eps"], group["lr"], group["weight_decay"]
        denominators: dict[tuple, Tensor] = {}
        for it in items:
            st = it.state
            t = st["step"]
            if wd != 0:
                F.decay_([it.param], 1.0 - lr * wd)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            g = it.grad.to(m.dtype)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            bc1 = 1.0 - beta1**t
            bc2 = 1.0 - beta2**t
            denom = torch.sqrt(v, out=buffer(denominators, "denominator", v.shape, v.dtype, v.device))
            if self.eps_before_correction:
                step_size = lr * math.sqrt(bc2) / bc1
            else:
                denom.div_(math.sqrt(bc2))
                step_size = lr / bc1
            it.param.addcdiv_(m, denom.add_(eps), value=-step_size)

    def step_foreach(self, items, group, ctx):
        """The same update as :meth:`step` in ``torch._foreach_*`` kernels, as ``torch.optim.AdamW``'s
        multi-tensor form: a fixed number of kernels per dtype and device, whatever the count."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        eps, lr = group["eps"], group["lr"]
        for b in make_buckets(items, matrix=False, transpose=False, by_shape=False):
            params = [it.param for it in b.items]
            ms = [it.state["exp_avg"] for it in b.items]
            vs = [it.state["exp_avg_sq"] for it in b.items]
            grads = grads_like(b.items, ms)
            if group["weight_decay"] != 0:
                F.decay_(params, 1.0 - lr * group["weight_decay"])
            torch._foreach_lerp_(ms, grads, 1.0 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
            steps = [it.state["step"] for it in b.items]
            bc1 = [1.0 - beta1**t for t in steps]
            bc2 = [1.0 - beta2**t for t in steps]
            denom = torch._foreach_sqrt(vs)
            if self.eps_before_correction:
                step_sizes = [-lr * math.sqrt(c2) / c1 for c1, c2 in zip(bc1, bc2, strict=True)]
            else:
                torch._foreach_div_(denom, [math.sqrt(c2) for c2 in bc2])
                step_sizes = [-lr / c1 for c1 in bc1]
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, ms, denom, step_sizes)


class AdamScale(AdamW):
    """SCALE's internal Adam for 1-D parameters (OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7):
    bias-corrected Adam with eps added to the uncorrected ``sqrt(v)``, decoupled weight decay."""

    name = "adam_scale"
    defaults = {"betas": (0.9, 0.999)}  # SCALE's (upstream's torch.optim.Adam default)
    eps_before_correction = True


