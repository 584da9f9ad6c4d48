"""The public optimizers: each is the engine plus a rule table and defaults.

| optimizer            | hidden            | embedding        | head             | vector        |
|----------------------|-------------------|------------------|------------------|---------------|
| MeqMuon              | meq_hidden        | equilibrate      | equilibrate      | rms_normalize |
| Muon (Moonlight)     | moonlight_hidden  | adamw            | adamw            | adamw         |
| NorMuon              | normuon_hidden    | adamw            | adamw            | adamw         |
| Scale (SCALE)        | scale_row         | scale_col        | scale_head       | adam_scale    |
| MuonOnlyHidden       | meq_hidden        | adamw            | adamw            | adamw         |
| MuonOnlyEmbedding    | moonlight_hidden  | equilibrate      | equilibrate      | adamw         |
| MuonOnlyVector       | moonlight_hidden  | adamw            | adamw            | rms_normalize |
| MuonEq (R, C, RC)    | muoneq_hidden     | adamw            | adamw            | adamw         |

The three ablations are the paper's Table 7: each starts from Muon and changes one kind. Every
optimizer takes ``compile=True`` and ``rules={kind: rule}`` (a user's :class:`meqmuon.HiddenRule`
variant for ``hidden``, say: docs/variants.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..functional import NS_COEFFICIENTS, NS_STEPS, Coefficients, canonical_coefficients
from .engine import RoleOptimizer
from .rule import MOMENTUM, RHO
from .rules.adam import ADAMW_BETAS, ADAMW_EPS

# Defaults shared by the paper's runs (section 4): Nesterov momentum 0.95, 5 NS steps with Keller Jordan's
# coefficients, RMS alignment rho = 0.2 (the momentum rules' defaults, driver.py), decoupled weight decay
# 0.1, AdamW betas (0.9, 0.95) for the AdamW parts of Muon and NorMuon (rules/adam.py).
WEIGHT_DECAY = 0.1
__all__ = ["ADAMW_BETAS", "ADAMW_EPS", "MOMENTUM", "RHO", "WEIGHT_DECAY", "MeqMuon", "Muon", "MuonEq", "MuonEqC",
           "MuonEqR", "MuonEqRC", "MuonOnlyEmbedding", "MuonOnlyHidden", "MuonOnlyVector", "NorMuon", "Scale"]


class _NewtonSchulzOptimizer(RoleOptimizer):
    """The constructor of the optimizers whose hidden rule runs Newton-Schulz (:class:`MeqMuon`, :class:`Muon`
    and its subclasses): the one signature, and so the one home of each keyword's default, that ``help()``
    shows for each of them; its arguments are documented in :class:`MeqMuon`. A kind's rule may take more
    keywords (``**hyperparameters``, with the defaults its ``defaults`` declares): AdamW's ``betas`` and
    ``eps`` for :class:`Muon`, NorMuon's ``beta2``, ``ns_method``."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = WEIGHT_DECAY,
        momentum: float = MOMENTUM,
        nesterov: bool = True,
        rho: float = RHO,
        ns_steps: int = NS_STEPS,
        ns_coefficients: Coefficients = NS_COEFFICIENTS,
        ns_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = None,
        foreach: bool | None = None,
        process_group: Any = None,
        compile: bool = False,
        rules: dict[str, Any] | None = None,
        **hyperparameters: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            rho=rho,
            ns_steps=ns_steps,
            ns_coefficients=canonical_coefficients(ns_coefficients),
            ns_dtype=ns_dtype,
            state_dtype=state_dtype,
            foreach=foreach,
        )
        super().__init__(params, defaults, process_group=process_group, compile=compile, rules=rules,
                         **hyperparameters)


class MeqMuon(_NewtonSchulzOptimizer):
    r"""MeqMuon: Matrix-Equilibrating Muon (Shi, Wang, Li; paper Algorithm 1).

    One momentum buffer per parameter, no second moments. For every parameter
    ``B_t = mu B_{t-1} + G_t`` and the direction input is ``G_t + mu B_t`` (Nesterov, default) or
    ``B_t``; then, by kind:

    - ``hidden`` (>=2-D body weights; 3-D+ viewed as ``(shape[0], -1)``):
      ``U = Orth(input)`` by quintic Newton-Schulz, and
      ``U~ = N_r(U) if gamma_r(U) >= gamma_c(U) else N_c(U)`` (eq. 8), chosen per matrix per step
      as a tensor operation (no host sync); see :meth:`selection_counts`.
    - ``embedding`` and ``head``: ``U~ = N_c(N_r(input))``, two-sided normalisation of the raw,
      unorthogonalised momentum (eq. 9).
    - ``vector``: ``U~ = input / (||input||_2 / sqrt(d))`` (eq. 10).

    Update (eq. 11): ``W <- (1 - lr*wd) W - rho * lr * U~``. Every ``U~`` has RMS 1 for a
    non-degenerate input, so the step RMS is ``rho * lr`` for all kinds and no ``sqrt(max(m, n))``
    factor is needed. Rows/columns with RMS <= 1e-7 count as zero and stay zero.

    Nesterov: the paper's experiments use Nesterov momentum with mu = 0.95 for hidden matrices
    (section 4) and Algorithm 1 writes the plain ``B_t``; this implementation applies the same
    ``nesterov`` flag to every kind (set ``nesterov`` per param group to change that for a kind).

    Args:
        params: parameters or param groups, ideally from :func:`meqmuon.param_groups`.
        lr: learning rate ``eta``.
        weight_decay: decoupled weight decay ``lambda``.
        momentum: ``mu`` in [0, 1).
        nesterov: use ``G_t + mu B_t`` as the direction input.
        rho: RMS alignment coefficient (target update RMS ``rho * lr``).
        ns_steps, ns_coefficients, ns_dtype: Newton-Schulz iterations, coefficients and compute dtype.
            ``ns_coefficients``: one ``(a, b, c)`` for every iteration (default: Jordan et al.'s
            quintic), ``"polar_express"`` (Amsel et al. 2025, Algorithm 1: per-iteration
            coefficients with a 1.01 safety factor, input divided by ``1.01 ||X||_F``; see
            :data:`meqmuon.functional.POLAR_EXPRESS`), or a list of ``ns_steps`` triples.
            ``ns_dtype=None`` (default) picks per device at step time: bf16 where the hardware runs it
            natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), float32 elsewhere, since bf16 is
            ~170x slower than float32 on an AVX2-only CPU (:func:`meqmuon.precision.resolve_ns_dtype`).
            An explicit dtype is always used.
        ns_method: the Newton-Schulz method, a name of :data:`meqmuon.optim.newton_schulz.NS_METHODS`
            (default ``"quintic"``, paper eq. 3); a keyword of every optimizer with a hidden-matrix rule
            (``HiddenRule.defaults``), as every rule's own hyperparameters are.
        state_dtype: dtype of the momentum buffers (default: the parameter's dtype).
        foreach: ``None`` (default): the batched step (shape buckets, ``torch._foreach_*``; see
            ``optim/driver.py``) where all parameters of a group are on CUDA, the per-tensor step
            elsewhere; ``True``/``False`` force one, as in torch.optim. Every optimizer here takes it.
        process_group: group over which the Newton-Schulz work of hidden matrices is split (DDP);
            ``None``: the default group if ``torch.distributed`` is initialised, else one process.
            DTensor (FSDP2) parameters follow their own mesh. See :mod:`meqmuon.optim.distributed`.
        compile: compile each hidden matrix's step (per-tensor: one graph per matrix shape; batched:
            one per bucket, momentum to update; FSDP2: the owners' ``pre -> NS -> post``) and the
            batched embedding/vector steps with ``torch.compile`` (:mod:`meqmuon.optim.compiled`).
            lr/weight-decay changes do not recompile. Every optimizer takes it; rules without a
            compiled form (AdamW, SCALE, the per-tensor embedding rule, already memory-bound) run
            eagerly. Needs inductor's toolchain (a C++ compiler on CPU).
        rules: ``{kind: rule instance}`` replacing the rule of each kind named, e.g.
            ``{"hidden": MyVariant()}`` with ``MyVariant`` a :class:`meqmuon.HiddenRule` subclass
            (docs/variants.md). Every optimizer takes it.
        **hyperparameters: the rules' own hyperparameters (each rule's ``defaults``, checked by its
            ``validate``), e.g. ``alpha=2.0`` for a variant that declares ``alpha``; any other keyword
            raises ``TypeError``.
    """

    RULES = {"hidden": "meq_hidden", "embedding": "equilibrate", "head": "equilibrate", "vector": "rms_normalize"}


class Muon(_NewtonSchulzOptimizer):
    r"""Muon in Moonlight's form (Liu et al. 2025, paper eq. 2), with AdamW for the other kinds.

    Follows MoonshotAI/Moonlight c2ad5b2 ``examples/toy_train.py``:

    - ``hidden``: ``B <- mu B + G``; ``O = Orth(G + mu B)`` (Nesterov) or ``Orth(B)``;
      ``W <- (1 - lr wd) W - lr * rho * sqrt(max(m, n)) * O``.
    - ``embedding``, ``head``, ``vector``: AdamW with the same ``lr`` and ``weight_decay``,
      ``betas=(0.9, 0.95)``, ``eps=1e-8``, in ``torch.optim.AdamW``'s form (eps after bias
      correction; Moonlight adds it before: 4.47x our effective eps at step 1, within 3 % from
      step 56; docs/algorithm.md, "Baselines").

    ``ns_dtype=None`` (default): bf16 Newton-Schulz where the device runs bf16 natively, float32
    elsewhere (:func:`meqmuon.precision.resolve_ns_dtype`); an explicit dtype is always used.

    Identical in exact arithmetic to ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` plus
    ``torch.optim.AdamW(betas=(0.9, 0.95))`` on the other parameters (tested).

    :class:`MeqMuon`'s keywords (one signature, ``_NewtonSchulzOptimizer``), and AdamW's own: ``betas``
    (default ``(0.9, 0.95)``) and ``eps`` (``1e-8``), keywords of the AdamW rule (``AdamW.defaults``, their one
    home). ``compile``, ``rules`` (e.g. ``rules={"hidden": MyVariant()}``, a :class:`meqmuon.HiddenRule`),
    ``foreach``, ``state_dtype``, ``process_group``, ``ns_method`` and the rules' own hyperparameters
    (``**hyperparameters``): as in :class:`MeqMuon`, for every optimizer here.
    """

    RULES = {"hidden": "moonlight_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class NorMuon(Muon):
    r"""NorMuon (Li et al. 2025) with AdamW for the other kinds, on Muon's lr grid.

    Hidden matrices (zichongli5/NorMuon d45c9a4 ``normuon_update``): Nesterov momentum,
    ``O = Orth(.)``, per-row second moment ``v <- beta2 v + (1 - beta2) mean_j O_ij^2`` (float32,
    one value per output row), ``O' = O / (sqrt(v) + 1e-10)`` rescaled to ``||O||_F``, and step
    ``lr * rho * sqrt(max(m, n)) * O'`` (dion's "rms_norm" scale instead of upstream's
    ``sqrt(max(1, m/n))``, so that NorMuon shares the lr grid of Muon and MeqMuon, as the paper
    compares them). Other kinds: AdamW as in :class:`Muon`.

    :class:`Muon`'s constructor (as ``torch.optim.AdamW(Adam)``), with one keyword of the NorMuon rule's
    own: ``beta2`` (default 0.95, upstream's; ``NorMuonHidden.defaults``).
    """

    RULES = {"hidden": "normuon_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class Scale(RoleOptimizer):
    r"""SCALE (Glentis, Li, Han, Hong; official code OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7).

    - ``hidden``: the raw gradient (no momentum), each row (output neuron) scaled to unit RMS.
    - ``embedding``: the raw gradient, each column (hidden coordinate) scaled to unit RMS over the
      vocabulary (upstream's ``dim=0`` for ``embed_tokens``).
    - ``head``: EMA momentum ``m <- lerp(m, g, 1 - momentum)`` (momentum 0.9), each row to unit RMS.
    - ``vector``: Adam with bias correction, eps added to the uncorrected ``sqrt(v)``.
    Slice RMS is clamped at 1e-8 as upstream. All kinds: ``W <- (1 - lr wd) W - lr D``.

    SCALE treats the embedding and the head differently, so a tied embedding/head tensor is
    undefined for it; such a group raises ``ValueError`` (the paper runs SCALE on untied Llama only).
    Upstream used ``lr=1e-3``, ``weight_decay=0`` and a separate peak lr of 2e-2 for 1-D parameters;
    give the vector group its own ``lr`` to reproduce that.
    """

    RULES = {"hidden": "scale_row", "embedding": "scale_col", "head": "scale_head", "vector": "adam_scale"}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = WEIGHT_DECAY,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        state_dtype: torch.dtype | None = None,
        foreach: bool | None = None,
        process_group: Any = None,
        compile: bool = False,
        rules: dict[str, Any] | None = None,
        **hyperparameters: Any,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, betas=tuple(betas), eps=eps, state_dtype=state_dtype,
            foreach=foreach,
        )
        super().__init__(params, defaults, process_group=process_group, compile=compile, rules=rules,
                         **hyperparameters)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("tied"):
            names = param_group.get("tied_names") or param_group.get("names") or []
            raise ValueError(
                f"SCALE cannot update a tied embedding/LM-head tensor {names}: it normalises the input embedding "
                "column-wise and the LM head row-wise with momentum, which is undefined for one shared tensor "
                "(the paper runs SCALE on untied Llama models only). Use an untied model."
            )
        super().add_param_group(param_group)


class MuonOnlyHidden(Muon):
    """Ablation (paper Table 7, "Only 2D weights in hidden layers"): Muon, but hidden matrices use
    MeqMuon's adaptive one-sided normalisation (scale ``rho``, no ``sqrt(max(m, n))``)."""

    RULES = {"hidden": "meq_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class MuonOnlyEmbedding(Muon):
    """Ablation (Table 7, "Only remaining 2D parameters"): Muon, but embeddings and LM heads use
    MeqMuon's two-sided normalisation of their momentum instead of AdamW."""

    RULES = {"hidden": "moonlight_hidden", "embedding": "equilibrate", "head": "equilibrate", "vector": "adamw"}


class MuonOnlyVector(Muon):
    """Ablation (Table 7, "Only 1D parameters"): Muon, but 1-D parameters use MeqMuon's global-RMS
    normalisation of their momentum instead of AdamW."""

    RULES = {"hidden": "moonlight_hidden", "embedding": "adamw", "head": "adamw", "vector": "rms_normalize"}


class MuonEq(Muon):
    r"""MuonEq (arXiv 2603.28254; official code MaeChd/muon-eq 99b6c8b,
    ``llm-opt-baseline-npu/llama2_pretrain/optimizers/muon_variants/muoneq.py``): :class:`Muon`
    whose hidden-matrix direction input is equilibrated *before* Newton-Schulz.

    ``B <- mu B + G``; ``U = G + mu B`` (Nesterov); ``U <- E(U)`` with ``mode``:

    - ``"R"``: each row divided by ``sqrt(||U_i,:||^2 + 1e-8)`` (the paper's default; the form
      karpathy/nanochat's fused Muon step uses),
    - ``"C"``: each column likewise,
    - ``"RC"``: both, from the same ``U`` (``U_ij / (||U_i,:|| ||U_:,j||)``, up to the eps);

    then ``W <- (1 - lr wd) W - lr rho sqrt(max(m, n)) Orth(U)``, and AdamW (betas (0.9, 0.95), as
    upstream's training scripts pass; eps after bias correction, where upstream adds it before as
    Moonlight does) for embeddings, heads and 1-D parameters: exactly :class:`Muon` but for ``E``.
    MuonEq equilibrates before orthogonalisation; MeqMuon normalises after it (and replaces AdamW).
    ``phase`` (mode RC only): from step ``phase`` on, R instead of RC, as upstream's phase switch
    (its counter starts at 1, so RC runs ``phase - 1`` steps).
    """

    RULES = {"hidden": "muoneq_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}
    #: The mode of the named presets (``muoneq-r`` ...); ``None``: the ``mode`` argument decides.
    MODE: ClassVar[str | None] = None

    def __init__(self, params: Any, lr: float = 1e-3, mode: str | None = None, phase: int | None = None,
                 **kwargs: Any) -> None:
        if self.MODE is not None and mode is not None and mode != self.MODE:
            raise ValueError(f"{type(self).__name__} is MuonEq mode {self.MODE}; got mode={mode!r} "
                             "(use MuonEq(mode=...) or the muoneq-r / muoneq-c / muoneq-rc names)")
        # mode and phase are the MuonEq rule's eq_mode and eq_phase (MuonEqHidden.defaults, checked there)
        if mode or self.MODE:
            kwargs["eq_mode"] = mode or self.MODE
        if phase is not None:
            kwargs["eq_phase"] = phase
        super().__init__(params, lr=lr, **kwargs)


class MuonEqR(MuonEq):
    """``muoneq-r``: :class:`MuonEq` with row equilibration."""

    MODE = "R"


class MuonEqC(MuonEq):
    """``muoneq-c``: :class:`MuonEq` with column equilibration."""

    MODE = "C"


class MuonEqRC(MuonEq):
    """``muoneq-rc``: :class:`MuonEq` with two-sided equilibration (and the optional ``phase`` switch to R)."""

    MODE = "RC"
