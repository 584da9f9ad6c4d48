"""The 2026 field's optimizers as presets (issues 48 and 58): each is a rule table over the engine, as
``presets.py``'s, with the new hidden-matrix rule, and, under its registry name, **its upstream recipe**
for every parameter kind (issue 58); the ``-shared`` names keep issue 48's presets, which give every kind but
the hidden one the shared protocol's AdamW (0.9, 0.95) at the group's lr and weight decay, no clipping.

| name             | hidden           | embedding        | head             | vector           | decay  | clipping   |
|------------------|------------------|------------------|------------------|------------------|--------|------------|
| muon-plus        | muonplus_hidden  | adamw_eps_before | adamw_eps_before | adamw_eps_before | 0.05   | all: 1     |
| muon-plus-shared | muonplus_hidden  | adamw            | adamw            | adamw            | group  | none       |
| muon-vs          | muon_vs          | adamw            | adamw            | adamw (decay 0)  | 0.1    | all: 1     |
| muon-vs-shared   | muon_vs          | adamw            | adamw            | adamw            | group  | none       |
| muonh            | muonh_hidden     | adamw, adam_lr   | adamh            | adamw, adam_lr   | none   | by rule: 1 |
| muonh-2026-01    | muonh_hidden     | adamw            | adamw            | adamw            | group  | none       |
| aurora           | aurora_hidden    | adamw            | aurora_hidden    | adamw            | 0.025  | none       |
| aurora-shared    | aurora_hidden    | adamw            | adamw            | adamw            | group  | none       |
| meqmuon-shape    | meq_shape_hidden | equilibrate      | equilibrate      | rms_normalize    | group  | none       |

("decay": the weight decay of every kind but where the row says otherwise; "group": the group's, the constructor's
``weight_decay``; "all: 1": every gradient clipped to global norm 1; "by rule: 1": each rule's set of gradients.)

Upstream, at the commits the tests pin (``tests/reference_2026/``; docs/algorithm.md, "The 2026 field"):

* **Muon+** (K1seki221/MuonPlus 8a9ace1, ``configs/llama60M_row-col.yaml``, ``utils/optim/muon_plus.py``,
  ``utils/train_distributed.py``): AdamW betas (0.95, 0.95) with eps added before the bias correction, weight
  decay 0.05 on every parameter, ``clip_grad_norm_(model.parameters(), 1.0)`` before each step.
* **Muon-VS** (jingru-lee/Variance-Adaptive-Muon 75f78ad, ``NanoGPT/gpt2/models/model.py``
  ``configure_optimizers``, ``train.py``, ``config/small_muon_vs.py``): one lr (6e-4) for Muon-VS and AdamW
  (0.9, 0.95), weight decay 0.1 on the matrices, embeddings and head and none on 1-D parameters,
  ``clip_grad_norm_(model.parameters(), 1.0)``.
* **MuonH** (levanter in marin-community/marin, ``lib/levanter/src/levanter/optim/muonh.py`` ``MuonHConfig``, after
  marin PR 2545 of 2026-01-29, which moved its Newton-Schulz to ``util.py`` with NVIDIA-NeMo's "quintic"
  coefficient schedule, :data:`NEMO_QUINTIC`): MuonH on the linear layers, AdamH on the LM head at MuonH's lr,
  Adam (no weight decay) on embeddings and everything else at its own ``adam_lr`` (6e-4) under the same
  schedule, no weight decay, and each of the three subsets' gradient clipped to global norm 1
  (``optax.clip_by_global_norm`` inside each ``multi_transform`` branch). ``muonh-2026-01`` is issue 48's preset:
  levanter's update before PR 2545 (ab6e485: Keller Jordan's coefficients) with the shared AdamW.
* **Aurora** (tilde-research/aurora-release 3d79a5c, ``README.md``, ``src/main.py``): ``aurora()`` for every
  weight matrix, the output layer included, weight decay 0.025. Its code has no rule for embeddings or 1-D
  parameters (``aurora`` refuses non-2-D tensors; its example has neither): those take the shared AdamW.

Every upstream normalises the Newton-Schulz input by ``||X||_F + eps`` (1e-7; levanter 1e-8), ours by
``max(||X||_F, 1e-7)``: the recipes take the ``ns_method`` ``"quintic+1e-7"`` / ``"quintic+1e-8"`` that does as
they do (equal also at gradient scale 1e-3), the ``-shared`` presets ours. The weight decay of a recipe is its
constructor's default; ``meqmuon train --weight-decay`` (0.1 unless given) replaces it, so the protocol passes
each recipe's value (docs/results/field-2026).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..functional import Coefficients
from .presets import MeqMuon, Muon
from .rules.aurora import AURORA_NS_COEFFICIENTS, AURORA_NS_STEPS

__all__ = ["NEMO_QUINTIC", "CLIP_SCOPES", "Aurora", "AuroraShared", "MeqMuonShape", "MuonH", "MuonH202601",
           "MuonPlus", "MuonPlusShared", "MuonVS", "MuonVSShared"]

#: NVIDIA-NeMo Emerging-Optimizers' "quintic" Newton-Schulz schedule, one (a, b, c) per iteration, as levanter's
#: ``NEWTON_SCHULZ_COEFFICIENTS["quintic"]`` holds it (marin 054a715f, ``lib/levanter/src/levanter/optim/util.py``,
#: ``zeropower_via_newtonschulz5``'s default since PR 2545; ``coeffs[i % 5]``, so 5 steps use each once).
NEMO_QUINTIC: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

#: ``clip_scope``: ``"all"``, one global norm over every parameter's gradient, scaled by ``min(1, c / (||g|| +
#: 1e-6))`` (``torch.nn.utils.clip_grad_norm_``, as Muon+'s and Muon-VS's training loops call it); ``"rule"``, one
#: global norm per set of parameters that share a rule, scaled by ``c / ||g||`` where ``||g|| >= c``
#: (``optax.clip_by_global_norm`` in each branch of levanter's ``multi_transform``).
CLIP_SCOPES = ("all", "rule")


class _Recipe:
    """What an upstream recipe sets besides the rule table: per-kind hyperparameters (``kind_defaults``: values a
    group of that kind takes unless it sets its own) and gradient clipping before the step (``clip_norm``,
    ``clip_scope``, :data:`CLIP_SCOPES`), with no host sync. A mixin in front of a ``RoleOptimizer`` preset."""

    #: kind -> {hyperparameter: value} that the recipe fixes for that kind.
    KIND_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, *args: Any, clip_norm: float | None = None, clip_scope: str = "all", **kwargs: Any) -> None:
        if clip_norm is not None and not (isinstance(clip_norm, int | float) and not isinstance(clip_norm, bool)
                                          and clip_norm > 0):
            raise ValueError(f"Invalid clip_norm: {clip_norm!r} (expected None or a positive number)")
        if clip_scope not in CLIP_SCOPES:
            raise ValueError(f"Invalid clip_scope: {clip_scope!r} (valid: {', '.join(CLIP_SCOPES)})")
        self._clip = (None if clip_norm is None else float(clip_norm), clip_scope)
        if clip_norm is not None and kwargs.get("cuda_graph"):
            raise ValueError("clip_norm with cuda_graph=True is not built: the captured step does not clip; pass "
                             "clip_norm=None and clip the gradients before step()")
        super().__init__(*args, **kwargs)

    def kind_defaults(self, kind: str | None) -> dict[str, Any]:
        """The hyperparameters the recipe fixes for a group of ``kind``."""
        return dict(self.KIND_DEFAULTS.get(kind, {})) if kind is not None else {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            for key, value in self.kind_defaults(param_group.get("kind")).items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_clip": self._clip}  # type: ignore[misc]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.__dict__.setdefault("_clip", (None, "all"))

    @torch.no_grad()
    def clip_gradients(self, grad_scale: torch.Tensor | None = None) -> None:
        """Scale the gradients in place as :data:`CLIP_SCOPES` says (nothing without ``clip_norm``). ``grad_scale``: the
        gradients are a ``GradScaler``'s scaled ones, which the step unscales: the norm clipped is theirs divided by
        it. A non-finite gradient makes every gradient non-finite, as ``clip_grad_norm_`` does: the step then skips
        (``nonfinite="skip"``)."""
        norm, scope = self._clip
        if norm is None:
            return
        scale = None if grad_scale is None else grad_scale.to(torch.float32)
        groups = self.param_groups  # type: ignore[attr-defined]
        if scope == "all":  # torch.nn.utils.clip_grad_norm_'s rule: max_norm / (total + 1e-6), at most 1
            grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            if grads:
                total, by = _total_norm(grads, scale)
                _scale_(by, torch.clamp(norm / (total + 1e-6), max=1.0))
            return
        sets: dict[str, list[torch.Tensor]] = {}
        for g in groups:
            for p in g["params"]:
                if p.grad is not None:
                    rule = self._rule_for(g.get("kind") or ("hidden" if p.ndim >= 2 else "vector"))  # type: ignore
                    sets.setdefault(rule.name, []).append(p.grad)
        for grads in sets.values():  # optax's clip_by_global_norm: norm / total where total exceeds it
            total, by = _total_norm(grads, scale)
            _scale_(by, torch.where(total < norm, torch.ones_like(total), norm / total))

    def _prepare_gradients(self, grad_scale: torch.Tensor | None) -> None:
        """The recipe's clipping (:meth:`clip_gradients`), called by the engine's step before it reads the gradients
        (after the closure), so that ``step`` stays the engine's one step."""
        self.clip_gradients(grad_scale)


# ---- issue 48's presets: the shared protocol's AdamW for every kind but the hidden one -------------------------


class MuonPlusShared(Muon):
    """Muon+ (arXiv 2602.21545) for hidden matrices: Muon with ``row_col`` normalisation after Newton-Schulz and
    upstream's ``sqrt(m/n)`` step multiplier (:class:`~meqmuon.optim.rules.muonplus.MuonPlusHidden`; ``norm_mode=``
    picks another mode); the shared AdamW (0.9, 0.95) for the other kinds at the same lr (issue 48's ``muon-plus``)."""

    RULES = {"hidden": "muonplus_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class MuonVSShared(Muon):
    """Muon-VS (arXiv 2601.14603) for hidden matrices: the momentum divided elementwise by the root of its
    bias-corrected variance before Newton-Schulz, Moonlight's step multiplier
    (:class:`~meqmuon.optim.rules.muon_vs.MuonVS`); the shared AdamW for the other kinds (issue 48's ``muon-vs``)."""

    RULES = {"hidden": "muon_vs", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class MuonH202601(Muon):
    """MuonH / hyperball (arXiv 2606.16899) as levanter had it before marin PR 2545 (ab6e485: Keller Jordan's
    coefficients), with the shared AdamW for the other kinds at MuonH's lr: issue 48's ``muonh``. Weights keep their
    initial Frobenius norm, each step ``lr`` times it (:class:`~meqmuon.optim.rules.muonh.MuonH`)."""

    RULES = {"hidden": "muonh_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class AuroraShared(Muon):
    """Aurora (arXiv 2606.27715) for hidden matrices: the leverage-uniform polar factor of rectangular matrices, two
    polars per step, each 12 simple-quintic Newton-Schulz iterations by default (upstream's ``polar``), and
    ``sqrt(max(1, m/n))`` (:class:`~meqmuon.optim.rules.aurora.AuroraHidden`); the shared AdamW for the other kinds
    (issue 48's ``aurora``)."""

    RULES = {"hidden": "aurora_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}

    def __init__(self, params: Any, lr: float = 1e-3, *, ns_steps: int = AURORA_NS_STEPS,
                 ns_coefficients: Coefficients = AURORA_NS_COEFFICIENTS, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, ns_steps=ns_steps, ns_coefficients=ns_coefficients, **kwargs)


# ---- the upstream recipes (issue 58) ------------------------------------------------------------------------------


class MuonPlus(_Recipe, MuonPlusShared):
    """Muon+ with its upstream recipe (module docstring): the hidden rule of :class:`MuonPlusShared` with
    upstream's Newton-Schulz normalisation (``"quintic+1e-7"``), AdamW (0.95, 0.95) with eps before the bias
    correction (:class:`~meqmuon.optim.rules.adam.AdamWEpsBefore`) for embeddings, head and vectors at the same lr,
    weight decay 0.05 on every kind, every gradient clipped to global norm 1 (``clip_scope="all"``)."""

    RULES = {"hidden": "muonplus_hidden", "embedding": "adamw_eps_before", "head": "adamw_eps_before",
             "vector": "adamw_eps_before"}

    def __init__(self, params: Any, lr: float = 1e-3, *, weight_decay: float = 0.05,
                 betas: tuple[float, float] = (0.95, 0.95), ns_method: str = "quintic+1e-7",
                 clip_norm: float | None = 1.0, clip_scope: str = "all", **kwargs: Any) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, betas=betas, ns_method=ns_method,
                         clip_norm=clip_norm, clip_scope=clip_scope, **kwargs)


class MuonVS(_Recipe, MuonVSShared):
    """Muon-VS with its upstream recipe (module docstring): the hidden rule of :class:`MuonVSShared` with upstream's
    Newton-Schulz normalisation (``"quintic+1e-7"``), AdamW (0.9, 0.95) for embeddings, head and vectors at the same
    lr, weight decay 0.1 except on vectors (none), every gradient clipped to global norm 1."""

    KIND_DEFAULTS = {"vector": {"weight_decay": 0.0}}

    def __init__(self, params: Any, lr: float = 1e-3, *, ns_method: str = "quintic+1e-7",
                 clip_norm: float | None = 1.0, clip_scope: str = "all", **kwargs: Any) -> None:
        super().__init__(params, lr=lr, ns_method=ns_method, clip_norm=clip_norm, clip_scope=clip_scope, **kwargs)


class MuonH(_Recipe, Muon):
    """MuonH with levanter's current recipe (module docstring): MuonH on hidden matrices with NeMo's quintic schedule
    (:data:`NEMO_QUINTIC`) and levanter's normalisation (``"quintic+1e-8"``, its ``muon_epsilon``), AdamH
    (:class:`~meqmuon.optim.rules.adam.AdamH`) on the head at ``lr``, Adam (AdamW without decay, (0.9, 0.95), eps
    1e-8) on embeddings and vectors at ``adam_lr`` (6e-4; a scheduler scales it as every group's lr), no weight
    decay (``weight_decay`` > 0 decays the hidden matrices and the head before their projection), each rule's set of
    gradients clipped to global norm 1 (``clip_scope="rule"``)."""

    RULES = {"hidden": "muonh_hidden", "embedding": "adamw", "head": "adamh", "vector": "adamw"}

    def __init__(self, params: Any, lr: float = 1e-3, *, weight_decay: float = 0.0, adam_lr: float = 6e-4,
                 ns_coefficients: Coefficients = NEMO_QUINTIC, ns_method: str = "quintic+1e-8",
                 clip_norm: float | None = 1.0, clip_scope: str = "rule", **kwargs: Any) -> None:
        if not (isinstance(adam_lr, int | float) and not isinstance(adam_lr, bool) and adam_lr >= 0):
            raise ValueError(f"Invalid adam_lr: {adam_lr!r} (expected a number >= 0)")
        self._adam_lr = float(adam_lr)
        super().__init__(params, lr=lr, weight_decay=weight_decay, ns_coefficients=ns_coefficients,
                         ns_method=ns_method, clip_norm=clip_norm, clip_scope=clip_scope, **kwargs)

    def kind_defaults(self, kind: str | None) -> dict[str, Any]:
        adam = {"lr": self._adam_lr, "weight_decay": 0.0}
        return adam if kind in ("embedding", "vector") else {}


class Aurora(_Recipe, AuroraShared):
    """Aurora with its upstream recipe (module docstring): :class:`AuroraShared`'s rule for every weight matrix, the
    LM head included, with upstream's Newton-Schulz normalisation (``"quintic+1e-7"``), the shared AdamW for
    embeddings and vectors (upstream has no rule for them), weight decay 0.025 on every kind, no clipping."""

    RULES = {"hidden": "aurora_hidden", "embedding": "adamw", "head": "aurora_hidden", "vector": "adamw"}

    def __init__(self, params: Any, lr: float = 1e-3, *, weight_decay: float = 0.025, ns_method: str = "quintic+1e-7",
                 **kwargs: Any) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, ns_method=ns_method, **kwargs)


class MeqMuonShape(MeqMuon):
    """``meqmuon-shape``: MeqMuon with eq. 8's row/column choice fixed by shape (tall and square: rows, wide:
    columns; :class:`~meqmuon.optim.rules.meq_shape.MeqShapeHidden`), an ablation of the CV choice."""

    RULES = {"hidden": "meq_shape_hidden", "embedding": "equilibrate", "head": "equilibrate",
             "vector": "rms_normalize"}


def _total_norm(grads: list[torch.Tensor], scale: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[tuple, list[torch.Tensor]]]:
    """The 2-norm of all of ``grads`` together, as ``torch.nn.utils.get_total_norm`` computes it (per device and
    dtype, each tensor's norm, then the norm of those), with one ``_foreach_norm`` per device and dtype, so that
    the number of kernels does not grow with the model's depth (``get_total_norm`` takes that path only on CUDA
    and loops over the tensors elsewhere; ``_foreach_norm`` on CPU is that loop, the same bits). Returns it and
    the gradients by device and dtype. ``scale``: a ``GradScaler``'s, which the norm is divided by."""
    by: dict[tuple, list[torch.Tensor]] = {}
    for t in grads:
        by.setdefault((t.device, t.dtype), []).append(t)
    first = grads[0].device
    norms = [n.to(first) for ts in by.values() for n in torch._foreach_norm(ts, 2.0)]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return (total if scale is None else total / scale.to(total.device)), by


def _scale_(by: dict[tuple, list[torch.Tensor]], scale: torch.Tensor) -> None:
    """Multiply every gradient of ``by`` (:func:`_total_norm`'s) by the 0-D ``scale``: one kernel per device and
    dtype, with no host sync."""
    for (device, dtype), ts in by.items():
        torch._foreach_mul_(ts, scale.to(device, dtype))
