"""Update rules: one object per rule, each turning gradients (and its state) into a parameter update.

An optimizer in this package is an assignment of rules to parameter kinds (see ``presets.py``).
Every rule applies decoupled weight decay and its step the same way,

    W <- (1 - lr * wd) * W - lr * scale * D,

where ``D`` is the rule's direction and ``scale`` its multiplier (``rho`` for MeqMuon's rules,
``rho * sqrt(max(m, n))`` for Moonlight's Muon, 1 for Adam-type and SCALE rules).

A rule receives all parameters of its kind in one param group at once and works through them one
at a time: each matrix's direction input is made just before its Newton-Schulz and dropped after
its update, so no model-sized temporary exists (on CPU, fresh 64 MB temporaries cost more in page
faults than the arithmetic; docs/benchmarks.md). On CPU Newton-Schulz runs matrix by matrix with
fused ``addmm`` (torch.optim.Muon's form): measured faster there than one batched call per shape,
and it makes each matrix's bits independent of its neighbours, which the DDP split relies on. On
GPUs each shape bucket is one batched call (``distributed.BATCHED_NS_DEVICES``). No rule makes a
host-device sync: step counters are Python ints, choices are tensors.

Momentum convention (paper eq. 6 and Moonlight): ``B_t = mu * B_{t-1} + G_t``; the direction input
is ``G_t + mu * B_t`` with Nesterov, else ``B_t``. torch.optim.Muon and NorMuon keep an EMA
``M = lerp(M, G, 1 - mu)`` instead; the two differ by the scalar ``1 - mu`` only, which every
normalising rule removes (Newton-Schulz, row/column/RMS normalisation are scale-invariant).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import functional as F
from . import blockwise, fused
from .distributed import LocalSplit, local, ns_flops, rows_state_like

# SCALE divides by the slice RMS clamped at this value (OptimAI-Lab/Minimalist_LLM_Pretraining
# f5bd4e7, mem_eff_pt/pt_scale/scale_optimizer.py: ``.clamp_min(1e-8)``).
SCALE_EPS = 1e-8
# NorMuon's epsilons (zichongli5/NorMuon d45c9a4, normuon.py): 1e-10 in the row scaling and in the
# Frobenius-norm restore.
NORMUON_EPS = 1e-10


def _matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def _shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonlight's RMS-matching factor ``sqrt(max(m, n))`` of the matrix view of a (global) shape."""
    m, n = _matrix_shape(shape)
    return math.sqrt(max(m, n))


class StepContext:
    """Per-step extras the engine hands to rules. ``capture`` is an opt-in diagnostics hook.

    When ``capture`` is set, momentum rules call it as ``capture(name, kind, "momentum_input", x)``
    with the direction input (the pre-Newton-Schulz matrix for hidden weights), and Adam/SCALE
    rules with ``"gradient"`` and the raw gradient. Default ``None``: no call, no cost.
    """

    __slots__ = ("capture", "kind", "split", "compile")

    def __init__(
        self,
        capture: Callable[[str, str, str, Tensor], None] | None = None,
        kind: str = "",
        split: LocalSplit | None = None,
        compile: bool = False,
    ) -> None:
        self.capture = capture
        self.kind = kind
        #: Use the torch.compile-fused normalise+update kernels of ``fused.py`` where a rule has one.
        self.compile = compile
        #: Work splitter (see ``distributed.py``): who orthogonalises which matrix, sums over shards.
        self.split = split if split is not None else LocalSplit()

    def emit(self, items: Sequence[Item], tensors: Sequence[Tensor], what: str) -> None:
        if self.capture is not None:
            for it, x in zip(items, tensors, strict=True):
                self.capture(it.name, self.kind, what, x)


class Item:
    """One parameter in a rule call: the tensor, its gradient, its state, its name and its global shape.

    Under FSDP2 ``param`` and ``grad`` are the local row shards (plain tensors sharing storage with
    the DTensors), ``shape`` the full shape, and state tensors are DTensors (read them with
    :func:`meqmuon.optim.distributed.local`).
    """

    __slots__ = ("param", "grad", "state", "name", "shape")

    def __init__(
        self, param: Tensor, grad: Tensor, state: dict[str, Any], name: str, shape: torch.Size | None = None
    ) -> None:
        self.param = param
        self.grad = grad
        self.state = state
        self.name = name
        self.shape = param.shape if shape is None else shape


def apply_update(
    items: Sequence[Item],
    directions: Sequence[Tensor],
    scales: Sequence[float],
    group: dict,
    scratch: dict[tuple, Tensor] | None = None,
) -> None:
    """``W <- (1 - lr*wd) W - lr * scale * D`` for every item (decoupled weight decay, unadjusted lr).

    Mixed dtypes compute in the wider one, as torch.optim.Muon's bf16 update into float32
    parameters. A narrower direction (bf16 Newton-Schulz output) is cast into a buffer kept in
    ``scratch`` per shape: ``p.add_(d)`` would cast it anyway, through a fresh parameter-sized
    temporary per call (TensorIterator promotes mixed-dtype inputs on CPU). Same bits.
    """
    lr, wd = group["lr"], group["weight_decay"]
    for it, d, s in zip(items, directions, scales, strict=True):
        p = it.param
        _decay_(p, lr, wd)
        d = d.reshape(p.shape)
        if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = _buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        p.add_(d, alpha=-lr * s)


def _decay_(param: Tensor, lr: float, wd: float) -> None:
    """Decoupled weight decay ``W <- (1 - lr wd) W`` in place, one tensor at a time as torch's
    single-tensor optimizers do: ``torch._foreach_mul_`` rounds the factor to the tensor's dtype,
    which for bf16 parameters turned 1 - 3e-3 into 0.9961 (30% more decay) and 1 - 1e-3 into 1."""
    if wd != 0:
        param.mul_(1.0 - lr * wd)


def _scaled_step(
    param: Tensor, u: Tensor, row: Tensor, col: Tensor, group: dict, scale: float, scratch: dict[tuple, Tensor]
) -> None:
    """``W <- (1 - lr wd) W - lr scale (u * row) * col`` in two passes over the matrix.

    Eager counterpart of ``fused.scaled_update``: ``u * row`` goes into a float32 buffer kept in
    ``scratch`` per shape, and the column factor is applied inside ``addcmul_``, instead of a cast,
    two scalings and an add over four parameter-sized temporaries. ``param`` is updated through its
    matrix view; a non-contiguous 3-D+ parameter has none (its matrix view would be a copy), so it
    is updated in its own shape from a whole direction tensor (same maths).
    """
    lr, wd = group["lr"], group["weight_decay"]
    _decay_(param, lr, wd)
    if param.ndim > 2 and not param.is_contiguous():
        param.add_(torch.mul(u, row).mul_(col).reshape(param.shape), alpha=-lr * scale)
        return
    W = param.view(u.shape)
    # Cast, then scale in place: ``torch.mul(u, row, out=...)`` with a bf16 ``u`` and a float32
    # ``row`` would make a float32 copy of ``u`` anyway (TensorIterator promotes mixed-dtype inputs
    # on CPU through a temporary), one fresh matrix per call. Same bits.
    row_scaled = _buffer(scratch, "row_scaled", u.shape, row.dtype, u.device).copy_(u).mul_(row)
    W.addcmul_(row_scaled, col, value=-lr * scale)


def _buffer(
    scratch: dict[tuple, Tensor], role: str, shape: torch.Size, dtype: torch.dtype = torch.float32, device=None
) -> Tensor:
    """A buffer for ``role`` kept in ``scratch`` and reused by same-shape matrices within a step."""
    key = (role, tuple(shape), dtype, device)
    if key not in scratch:
        scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return scratch[key]


def _state_dtype(p: Tensor, group: dict) -> torch.dtype:
    return group.get("state_dtype") or p.dtype


def _update_momentum(items: Sequence[Item], group: dict) -> None:
    """``B <- mu B + G`` in place, one pass per tensor (``torch.add(G, B, alpha=mu, out=B)``)."""
    mu = group["momentum"]
    for it in items:
        b = local(it.state["momentum_buffer"])
        g = it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype)
        torch.add(g, b, alpha=mu, out=b)


def _direction_input(it: Item, group: dict, rows: slice = slice(None), out: Tensor | None = None) -> Tensor:
    """Rows ``rows`` of the direction input of a momentum rule: ``G + mu B`` with Nesterov (into
    ``out`` if given, else a new tensor), else ``B`` itself. Made on demand, per parameter (or block
    of rows), so that no model-sized temporary exists at once and DDP ranks make only the inputs of
    what they own."""
    b = local(it.state["momentum_buffer"])[rows]
    if not group["nesterov"]:
        return b
    g = it.grad[rows]
    return torch.add(g if g.dtype == b.dtype else g.to(b.dtype), b, alpha=group["momentum"], out=out)


class Rule:
    """Base class. Subclasses set ``name``, the state they keep and implement ``step``."""

    name: ClassVar[str]
    #: Parameter kinds this rule accepts (matrix rules need >=2-D tensors).
    needs_matrix: ClassVar[bool] = False
    #: Hyperparameter keys the rule reads from its group (validated by the engine).
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def state_elements(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Number of state elements (excluding scalar counters) kept for a parameter of ``shape``."""
        raise NotImplementedError

    def init_state(self, p: Tensor, state: dict[str, Any], group: dict) -> None:
        raise NotImplementedError

    def step(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# Momentum-based normalising rules (MeqMuon, Moonlight Muon, NorMuon)
# --------------------------------------------------------------------------------------------

#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (``_MomentumRule.cost``). Measured on this package's CPU (2-core EPYC, 1 thread per rank): the
#: row-blocked equilibration of a 32000 x 512 matrix took about as long as 1000 FLOPs per element
#: of Newton-Schulz at the bf16 matmul rate. A balance heuristic only; results never depend on it.
ELEMENTWISE_COST = 1000.0


class _MomentumRule(Rule):
    """Momentum ``B <- mu B + G`` (every rank, every parameter), then ``update`` on the owned ones.

    Under DDP (``ReplicatedSplit``) each parameter's ``update`` runs on one owner rank, which then
    broadcasts the parameter and the ``owner_state`` entries; everywhere else every rank owns all.
    """

    hyperparameters = ("momentum", "nesterov")
    #: Per-parameter state besides the momentum that ``update`` changes (broadcast by the owner).
    owner_state: ClassVar[tuple[str, ...]] = ()
    #: Split updates over DDP ranks; False where repeating the work is cheaper than sending it.
    split_work: ClassVar[bool] = True

    def state_elements(self, shape):
        return math.prod(shape)

    def init_state(self, p, state, group):
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=_state_dtype(p, group), memory_format=torch.preserve_format
        )
        state["step"] = 0

    def cost(self, shape: torch.Size | tuple[int, ...], group: dict) -> float:
        """Estimated cost of one ``update`` of a parameter of (global) ``shape``, for owner balancing."""
        return ELEMENTWISE_COST * math.prod(shape)

    def update(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """Compute the directions of ``items`` (momentum already updated) and apply the step."""
        raise NotImplementedError

    def step(self, items, group, ctx):
        for it in items:
            it.state["step"] += 1
        _update_momentum(items, group)
        if ctx.capture is not None:
            ctx.emit(items, [_direction_input(it, group) for it in items], "momentum_input")
        if not self.split_work:
            self.update(items, group, ctx)
            return
        owners = ctx.split.owners([self.cost(it.shape, group) for it in items])
        mine = [it for it, o in zip(items, owners, strict=True) if o == ctx.split.rank]
        if mine:
            self.update(mine, group, ctx)
        ctx.split.publish([[it.param, *(local(it.state[k]) for k in self.owner_state)] for it in items], owners)


class _HiddenRule(_MomentumRule):
    """A rule that orthogonalises (Newton-Schulz, paper eq. 3) each hidden matrix's direction input."""

    needs_matrix = True

    def cost(self, shape, group):
        return ns_flops(*_matrix_shape(shape), group["ns_steps"]) + super().cost(shape, group)

    def orthogonalized(self, items: Sequence[Item], group: dict, ctx: StepContext) -> Iterator[tuple[int, Tensor]]:
        """``(i, Orth(X_i))`` for every item, one at a time; ``X_i`` is made just before its NS."""
        shapes = [_matrix_shape(it.shape) for it in items]
        if ctx.split.sharded:  # ShardedSplit gathers all inputs before its all-to-all: no sharing
            return ctx.split.orthogonalize(lambda i: _direction_input(items[i], group), shapes, group)
        # Otherwise each input is consumed (copied into the NS buffer) before the next is made, so
        # same-shape inputs can share one buffer: fresh temporaries are page faults on CPU.
        scratch: dict[tuple, Tensor] = {}

        def input_of(i: int) -> Tensor:
            b = local(items[i].state["momentum_buffer"])
            return _direction_input(items[i], group, out=_buffer(scratch, "nesterov", b.shape, b.dtype, b.device))

        return ctx.split.orthogonalize(input_of, shapes, group)


class MeqHidden(_HiddenRule):
    """MeqMuon for hidden matrices (paper Algorithm 1, eq. 8): ``U = Orth(B)``, then row- or
    column-normalise ``U``, whichever side has the larger CV (ties: rows). Scale ``rho``.

    Keeps a 0-D int64 counter ``rows_chosen`` per parameter on its device (no sync)."""

    name = "meq_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")
    owner_state = ("rows_chosen",)

    def init_state(self, p, state, group):
        super().init_state(p, state, group)
        # Plain tensor even under FSDP2: every rank makes the same choice for the whole matrix.
        state["rows_chosen"] = torch.zeros((), dtype=torch.int64, device=p.device)

    def update(self, items, group, ctx):
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            it = items[i]
            if ctx.compile and ctx.split.psum is None:  # whole matrix: statistics and step in one graph
                chose_rows = fused.adaptive_update(it.param, u, group, group["rho"])
            else:  # statistics eager (under FSDP2 they need cross-shard sums), then the scaled step
                squares = _buffer(scratch, "squares", u.shape, F._stat_dtype(u), u.device)
                row, col, chose_rows = F.adaptive_scales(
                    u, psum=ctx.split.psum, rows=_matrix_shape(it.shape)[0], scratch=squares
                )
                if ctx.compile:  # scaling, decay and step in one compiled kernel
                    fused.scaled_update(it.param, u, row, col, group, group["rho"])
                else:
                    _scaled_step(it.param, u, row, col, group, group["rho"], scratch)
            it.state["rows_chosen"].add_(chose_rows)


class MoonlightHidden(_HiddenRule):
    """Muon in Moonlight's form (paper eq. 2; MoonshotAI/Moonlight c2ad5b2 examples/toy_train.py):
    ``W <- (1 - lr wd) W - lr * rho * sqrt(max(m, n)) * Orth(B)``."""

    name = "moonlight_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")

    def update(self, items, group, ctx):
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            apply_update([items[i]], [u], [group["rho"] * _shape_scale(items[i].shape)], group, scratch)


class NorMuonHidden(_HiddenRule):
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

    def state_elements(self, shape):
        return math.prod(shape) + shape[0]

    def init_state(self, p, state, group):
        super().init_state(p, state, group)
        state["second_moment"] = rows_state_like(p, torch.promote_types(p.dtype, torch.float32))

    def update(self, items, group, ctx):
        beta2 = group["beta2"]
        psum = ctx.split.psum
        scratch: dict[tuple, Tensor] = {}  # reused by same-shape matrices: no fresh temporaries
        for i, O in self.orthogonalized(items, group, ctx):
            it = items[i]
            dtype = torch.promote_types(O.dtype, torch.float32)
            if O.dtype != dtype:
                O = _buffer(scratch, "O", O.shape, dtype, O.device).copy_(O)
            work = _buffer(scratch, "work", O.shape, dtype, O.device)
            # Rows are whole on every shard, so the per-row second moment is local under FSDP2.
            state_v = local(it.state["second_moment"])
            v = state_v.to(O.dtype)
            v.lerp_(torch.mul(O, O, out=work).mean(dim=-1), 1.0 - beta2)
            scaled = torch.div(O, v.sqrt().unsqueeze(-1) + NORMUON_EPS, out=work)
            if psum is None:
                fro_o = torch.linalg.vector_norm(O)
                fro_s = torch.linalg.vector_norm(scaled)
            else:  # Frobenius norms of the whole matrix: sum the shards' sums of squares
                sq = psum(torch.stack([O.square().sum(), scaled.square().sum()]))
                fro_o, fro_s = sq[0].sqrt(), sq[1].sqrt()
            scaled.mul_(fro_o / (fro_s + NORMUON_EPS))
            state_v.copy_(v)
            apply_update([it], [scaled], [group["rho"] * _shape_scale(it.shape)], group)


class Equilibrate(_MomentumRule):
    """MeqMuon for embeddings and LM heads (paper eq. 9): ``N_c(N_r(B))``, scale ``rho``.

    Row-blocked (``blockwise.equilibrate_step_``), so the 32000 x d direction is never
    materialised. ``compile=True`` changes nothing here: the two blocked passes already run at
    memory bandwidth. The compiled whole-matrix kernel used before could not take FSDP2's
    cross-shard sums, and with it the whole step was only 2-5% faster than eager, within this
    machine's run-to-run noise (docs/benchmarks.md)."""

    name = "equilibrate"
    needs_matrix = True
    hyperparameters = ("momentum", "nesterov", "rho")

    def update(self, items, group, ctx):
        for it in items:
            blockwise.equilibrate_step_(
                it.param,
                lambda rows, it=it: _direction_input(it, group, rows),
                group["lr"],
                group["weight_decay"],
                group["rho"],
                psum=ctx.split.psum,
                rows=_matrix_shape(it.shape)[0],
            )


class RmsNormalize(_MomentumRule):
    """MeqMuon for 1-D parameters (paper eq. 10): ``B / (||B||_2 / sqrt(d))``, scale ``rho``.

    Not split over DDP ranks: 1-D parameters are small, so repeating the update on every rank is
    cheaper than one broadcast per tensor."""

    name = "rms_normalize"
    hyperparameters = ("momentum", "nesterov", "rho")
    split_work = False

    def update(self, items, group, ctx):
        psum = ctx.split.psum
        for it in items:
            direction = F.rms_normalize(_direction_input(it, group), psum=psum, numel=math.prod(it.shape))
            apply_update([it], [direction], [group["rho"]], group)


# --------------------------------------------------------------------------------------------
# Adam-type rules
# --------------------------------------------------------------------------------------------


class AdamW(Rule):
    """AdamW exactly as ``torch.optim.AdamW`` (paper eq. 1-2): eps added after bias correction.

    Used for embedding/head/vector kinds by Muon and NorMuon. Moonlight's toy_train.py adds eps to
    the uncorrected ``sqrt(v)``; the two differ only in the first steps (baselines.md section 2),
    and torch's form is what the paper states (eq. 1) and lets us test parity with
    ``torch.optim.AdamW`` exactly.
    """

    name = "adamw"
    hyperparameters = ("betas", "eps")
    #: Moonlight/SCALE form: eps added to the uncorrected sqrt(v).
    eps_before_correction: ClassVar[bool] = False

    def state_elements(self, shape):
        return 2 * math.prod(shape)

    def init_state(self, p, state, group):
        dtype = _state_dtype(p, group)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def step(self, items, group, ctx):
        """In place, in ``torch.optim.AdamW``'s single-tensor order (its CPU default):
        ``W *= 1 - lr wd``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 - beta2) g^2``;
        ``W -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` as one ``addcdiv_``. The denominator goes
        into one buffer per shape, reused across the group's parameters: the old form made four
        parameter-sized temporaries per tensor, which made our Muon 1.18x torch's on Llama-60M
        (docs/benchmarks.md)."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        eps, lr, wd = group["eps"], group["lr"], group["weight_decay"]
        denominators: dict[tuple, Tensor] = {}
        for it in items:
            st = it.state
            st["step"] += 1
            t = st["step"]
            _decay_(it.param, lr, wd)
            m, v = local(st["exp_avg"]), local(st["exp_avg_sq"])
            g = it.grad.to(m.dtype)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            bc1 = 1.0 - beta1**t
            bc2 = 1.0 - beta2**t
            denom = torch.sqrt(v, out=_buffer(denominators, "denominator", v.shape, v.dtype, v.device))
            if self.eps_before_correction:
                step_size = lr * math.sqrt(bc2) / bc1
            else:
                denom.div_(math.sqrt(bc2))
                step_size = lr / bc1
            it.param.addcdiv_(m, denom.add_(eps), value=-step_size)


class AdamScale(AdamW):
    """SCALE's internal Adam for 1-D parameters (OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7):
    bias-corrected Adam with eps added to the uncorrected ``sqrt(v)``, decoupled weight decay."""

    name = "adam_scale"
    eps_before_correction = True


# --------------------------------------------------------------------------------------------
# SCALE (Glentis et al.; official code OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7)
# --------------------------------------------------------------------------------------------


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scale_row(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    # Row statistics are local to a row shard: psum/rows are not needed.
    x = _at_least_fp32(F.as_matrix(x))
    return x / x.square().mean(dim=-1, keepdim=True).sqrt().clamp(min=SCALE_EPS)


def _scale_col(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    x = _at_least_fp32(F.as_matrix(x))
    if psum is None:
        ms = x.square().mean(dim=-2, keepdim=True)
    else:  # column sums of squares over all row shards
        ms = psum(x.square().sum(dim=-2, keepdim=True)) / rows
    return x / ms.sqrt().clamp(min=SCALE_EPS)


class _ScaleRaw(Rule):
    """SCALE without momentum: normalise the raw gradient slice-wise; no state."""

    normalise: ClassVar[Callable[[Tensor], Tensor]]
    needs_matrix = True

    def state_elements(self, shape):
        return 0

    def init_state(self, p, state, group):
        state["step"] = 0

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        for it in items:
            it.state["step"] += 1
        psum = ctx.split.psum
        directions = [type(self).normalise(it.grad, psum, _matrix_shape(it.shape)[0]) for it in items]
        apply_update(items, directions, [1.0] * len(items), group)


class ScaleRow(_ScaleRaw):
    """SCALE for hidden matrices: raw gradient, each row (output neuron) to unit RMS over inputs."""

    name = "scale_row"
    normalise = staticmethod(_scale_row)


class ScaleCol(_ScaleRaw):
    """SCALE for the input embedding ``(vocab, d)``: each column (hidden coordinate) to unit RMS over the vocabulary."""

    name = "scale_col"
    normalise = staticmethod(_scale_col)


class ScaleHead(Rule):
    """SCALE for the LM head: EMA momentum ``m <- lerp(m, g, 1 - beta)`` (no Nesterov, no bias
    correction), then each vocabulary row to unit RMS."""

    name = "scale_head"
    needs_matrix = True
    hyperparameters = ("momentum",)

    def state_elements(self, shape):
        return math.prod(shape)

    def init_state(self, p, state, group):
        state["step"] = 0
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=_state_dtype(p, group), memory_format=torch.preserve_format
        )

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        directions = []
        for it in items:
            it.state["step"] += 1
            m = local(it.state["momentum_buffer"])
            m.lerp_(it.grad.to(m.dtype), 1.0 - group["momentum"])
            directions.append(_scale_row(m))
        apply_update(items, directions, [1.0] * len(items), group)


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        MeqHidden(),
        MoonlightHidden(),
        NorMuonHidden(),
        Equilibrate(),
        RmsNormalize(),
        AdamW(),
        AdamScale(),
        ScaleRow(),
        ScaleCol(),
        ScaleHead(),
    )
}
