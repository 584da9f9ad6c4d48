"""Adam-type rules, per-tensor (``step``) and batched (``step_foreach``, torch's multi-tensor form) side by side:
AdamW exactly as ``torch.optim.AdamW``, its form with eps before the bias correction (Moonlight's, Muon+'s),
SCALE's internal Adam, and AdamH (levanter's Adam on the hyperball, MuonH's rule for the LM head)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from .. import commit
from ..calls import state_dtype
from ..driver import buffer, grads_like, make_buckets
from ..inputs import number
from ..rule import SteppingRule
from .muonh import MuonH

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
    #: Its writes read the step's skip flag (:meth:`_gated`): no copies of its state.
    gates_itself = True

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
        temporaries (docs/benchmarks.md). Gated (:meth:`_gated`) where the step may be skipped."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        self._by_state_dtype(items, group, ctx.gate, self._step_single, foreach=False)

    def _by_state_dtype(self, items, group, gate, run, *, foreach: bool) -> None:
        """``run(items, group, gate)``: gated in its own kernels (:meth:`_gated`) for float32 and float64 state; a
        narrower state (bf16 ``state_dtype``, whose 0-D factors would round) ungated on copies written back unless
        the step is skipped (``commit.stepping_``)."""
        wide = [it for it in items if it.state["exp_avg"].dtype in (torch.float32, torch.float64)]
        narrow = [it for it in items if it.state["exp_avg"].dtype not in (torch.float32, torch.float64)]
        if wide or gate is None:
            run(wide if gate is not None else items, group, gate)
        if narrow and gate is not None:
            commit.stepping_(lambda its: run(its, group, None), narrow, foreach=foreach, elementwise=True, gate=gate)

    def _step_single(self, items, group, gate) -> None:
        """:meth:`step`'s loop (``gate``: the step's skip flag, or ``None``)."""
        if not items:
            return
        beta1, beta2 = group["betas"]
        eps, lr, wd = group["eps"], group["lr"], group["weight_decay"]
        denominators: dict[tuple, Tensor] = {}
        for it in items:
            st = it.state
            t = st["step"]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            g = it.grad.to(m.dtype)
            b2, keep = self._gated(gate, beta2, m)
            if wd != 0:
                commit.decay_([it.param], 1.0 - lr * wd, gate)
            if gate is None:
                m.lerp_(g, 1.0 - beta1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - beta2)
            else:  # the gradient sanitised: -0.0 for v, then m itself for m's lerp, on a skipped step
                skip = gate.skip(g.device)
                g = torch.where(skip, -0.0, g)
                v.mul_(b2).addcmul_(g, g, value=1.0 - beta2)
                m.lerp_(torch.where(skip, m, g, out=g), 1.0 - beta1)
            del g
            bc1 = 1.0 - beta1**t
            bc2 = 1.0 - beta2**t
            denom = torch.sqrt(v, out=buffer(denominators, "denominator", v.shape, v.dtype, v.device))
            if self.eps_before_correction:
                step_size = lr * math.sqrt(bc2) / bc1
            else:
                denom.div_(math.sqrt(bc2))
                step_size = lr / bc1
            denom.add_(eps)
            if keep is not None:
                denom.div_(keep)
            it.param.addcdiv_(m, denom, value=-step_size)

    @staticmethod
    def _gated(gate: commit.Gate | None, beta2: float, like: Tensor) -> tuple:
        """``(beta2, keep)``: the step's factors where it may be skipped (``gate``, ``commit.Gate``). On a skipped
        step the gradient ``v`` reads is ``-0.0`` and ``beta2`` is 1, so that ``v`` keeps its bits; the gradient ``m``'s
        lerp reads is ``m`` itself (``lerp(m, m, w) = m``); the denominator is divided by ``keep`` = 0, so that the
        step adds ``m / inf = 0``. The kernels of the ungated step (``lerp`` by its Python weight: a tensor weight
        would be read on the host), no copy of the state; float32 and float64 state take 0-D factors at the bits of
        the Python numbers. ``(beta2, None)`` where nothing can skip the step."""
        if gate is None:
            return beta2, None
        return gate.factor(beta2, like.dtype, like.device), gate.weight(1.0, like.dtype, like.device)

    def step_foreach(self, items, group, ctx):
        """The same update as :meth:`step` in ``torch._foreach_*`` kernels, as ``torch.optim.AdamW``'s
        multi-tensor form: a fixed number of kernels per dtype and device, whatever the count. Gated where the step
        may be skipped (:meth:`_gated`): the gradients one sanitised flat copy, let go before the denominators."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        for b in make_buckets(items, matrix=False, transpose=False, by_shape=False):
            self._by_state_dtype(b.items, group, ctx.gate, self._step_bucket, foreach=True)

    def _step_bucket(self, items, group, gate) -> None:
        """:meth:`step_foreach` of one dtype and device's ``items`` (``gate``: the step's skip flag, or ``None``)."""
        if not items:
            return
        beta1, beta2 = group["betas"]
        eps, lr = group["eps"], group["lr"]
        params = [it.param for it in items]
        ms = [it.state["exp_avg"] for it in items]
        vs = [it.state["exp_avg_sq"] for it in items]
        b2, keep = self._gated(gate, beta2, ms[0])
        if group["weight_decay"] != 0:
            commit.decay_(params, 1.0 - lr * group["weight_decay"], gate)
        if gate is None:
            grads = grads_like(items, ms)
            torch._foreach_lerp_(ms, grads, 1.0 - beta1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
            del grads
        else:  # one sanitised flat copy of the gradients, -0.0 for v, then m itself for m's lerp (skipped step)
            flat, grads = commit.sanitized([it.grad for it in items], gate, ms[0].dtype)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
            commit.select_(flat, grads, ms, gate)
            torch._foreach_lerp_(ms, grads, 1.0 - beta1)
            del flat, grads
        steps = [it.state["step"] for it in items]
        bc1 = [1.0 - beta1**t for t in steps]
        bc2 = [1.0 - beta2**t for t in steps]
        denom = torch._foreach_sqrt(vs)
        if self.eps_before_correction:
            step_sizes = [-lr * math.sqrt(c2) / c1 for c1, c2 in zip(bc1, bc2, strict=True)]
        else:
            torch._foreach_div_(denom, [math.sqrt(c2) for c2 in bc2])
            step_sizes = [-lr / c1 for c1 in bc1]
        torch._foreach_add_(denom, eps)
        if keep is not None:
            torch._foreach_div_(denom, keep)
        torch._foreach_addcdiv_(params, ms, denom, step_sizes)


class AdamWEpsBefore(AdamW):
    """AdamW with eps added to the uncorrected ``sqrt(v)``: ``W -= lr sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) +
    eps)``, Moonlight's ``toy_train.py`` form and Muon+'s (K1seki221/MuonPlus 8a9ace1, ``utils/optim/muon_plus.py``,
    ``MuonPlus.step``'s AdamW branch: ``g = m / (eps + sqrt(v))``, ``p -= lr / (bc1 / sqrt(bc2)) g``). Its effective
    eps is ``1 / sqrt(1 - beta2^t)`` times :class:`AdamW`'s: with beta2 0.95, 4.47x at step 1, within 3 % from step
    56; at unit gradients the two differ by ~5e-5 of the update in the first steps, at gradient scale 1e-3 by ~5e-2
    (issue 58). Otherwise :class:`AdamW`."""

    name = "adamw_eps_before"
    eps_before_correction = True


class AdamH(SteppingRule):
    r"""AdamH (levanter's ``scale_by_adamh``; marin-community/marin, ``lib/levanter/src/levanter/optim/adamh.py``,
    MuonH's rule for the LM head, ``MuonHConfig.create_mask``): Adam's direction moved on the hyperball, per matrix::

        m <- beta1 m + (1 - beta1) G;  v <- beta2 v + (1 - beta2) G^2            (optax's moments)
        U = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)                (eps after the correction)
        W' = W - lr U ||W||_F / max(||U||_F, 1e-10);  W <- W' ||W||_F / ||W'||_F

    as :class:`~meqmuon.optim.rules.muonh.MuonH`'s projection (:meth:`MuonH.project`, the same code): every matrix
    keeps its Frobenius norm and ``lr`` is a relative step, MuonH's ``lr``. Upstream has no weight decay; with
    ``weight_decay > 0`` the decay comes first and the projection restores the norm, as in MuonH. The projection
    reads each whole matrix's norms: on row pieces (FSDP2, tensor parallelism's vocabulary rows: ``placement.ROWS``)
    their sums of squares are summed over the pieces (``ctx.split.psum``), elsewhere the exchange hands it whole
    matrices (``exchange.whole_step``)."""

    name = "adamh"
    defaults = {"betas": ADAMW_BETAS, "eps": ADAMW_EPS}
    needs_matrix = True
    state_views: ClassVar[dict[str, str]] = {"exp_avg": "param", "exp_avg_sq": "param"}

    def validate(self, group):
        """As :class:`AdamW`'s: ``betas`` a pair in [0, 1), ``eps`` >= 0."""
        AdamW.validate(self, group)

    def state_elements(self, layout):
        return 2 * math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        AdamW.init_state(self, p, state, group, layout)

    def step(self, items, group, ctx):
        """Per tensor: the moments in place, the direction, then :meth:`MuonH.project` of the one matrix."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        for it in items:
            st, t = it.state, it.state["step"]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            g = it.grad.to(m.dtype)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            U = (m / (1.0 - beta1**t)).div_(v.div(1.0 - beta2**t).sqrt_().add_(group["eps"]))
            MuonH.project(it.param[None], U.to(it.param.dtype)[None], group, ctx.split.psum)

    def step_foreach(self, items, group, ctx):
        """The moments and directions in ``torch._foreach_*`` kernels, then each matrix's projection."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        ms = [it.state["exp_avg"] for it in items]
        vs = [it.state["exp_avg_sq"] for it in items]
        grads = grads_like(items, ms)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        steps = [it.state["step"] for it in items]
        Us = torch._foreach_div(ms, [1.0 - beta1**t for t in steps])
        den = torch._foreach_div(vs, [1.0 - beta2**t for t in steps])
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, group["eps"])
        torch._foreach_div_(Us, den)
        for it, U in zip(items, Us, strict=True):
            MuonH.project(it.param[None], U.to(it.param.dtype)[None], group, ctx.split.psum)


class AdamScale(AdamW):
    """SCALE's internal Adam for 1-D parameters (OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7):
    bias-corrected Adam with eps added to the uncorrected ``sqrt(v)``, decoupled weight decay."""

    name = "adam_scale"
    defaults = {"betas": (0.9, 0.999)}  # SCALE's (upstream's torch.optim.Adam default)
    eps_before_correction = True


