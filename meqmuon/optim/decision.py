"""The step's one decision: taken, or skipped for every parameter (issue 56).

A step is skipped where any gradient it reads holds a NaN or an infinity (``nonfinite="skip"``, the default), where a
``GradScaler`` says so (``found_inf``), or, under ``torch.distributed``, where any rank raised before its writes. The
decision is one 0-D float32 flag on the device (:func:`gate`). On a GPU it is never read on the host under ``"skip"``:
the step's writes fold it in (``commit.Gate``). On a CPU, where reading it waits for nothing, it is read once the
directions exist (:func:`settle`), and the writes are the ungated ones or none. Under ``torch.distributed`` the ranks
agree on it in one 4-byte all-reduce (:func:`agree`) first. Each stepped parameter counts it in its
``"skipped_steps"`` (:func:`count_skipped`). Functions of the optimizer (``engine.RoleOptimizer``): its
``nonfinite`` mode, its kept constants and its process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .commit import SKIPPED, Commit, Gate, constant
from .distributed import local

__all__ = ["NONFINITE", "ON_HOST", "agree", "count_skipped", "gate", "decide", "raise_nonfinite", "settle"]

#: What a step does with a non-finite gradient (``nonfinite=``, every optimizer's keyword; docs/algorithm.md,
#: "Non-finite gradients"): ``"skip"`` (the default) the whole step, for every parameter, decided on the device with
#: no host sync and counted in each parameter's state (``"skipped_steps"``); ``"raise"`` a ``RuntimeError`` naming
#: the first parameter whose gradient is non-finite, before anything is written (one host sync per step, by choice);
#: ``"propagate"`` steps anyway, as torch's optimizers do (one NaN then spreads over its matrix and its momentum).
NONFINITE = ("skip", "raise", "propagate")

#: The device types whose skip flag the step reads on the host (:func:`settle`). A CPU has computed the flag by the
#: time the step reads it: there is no device to wait for, so reading it costs nothing, and a taken step then makes
#: the writes of ``nonfinite="propagate"``, in their kernels and bits, and a skipped one none. Folding the flag into
#: every write instead (``commit.Gate``: selects and sanitised copies, which torch's CPU kernels run at 2-3x an
#: ``add_``'s time) made the CPU step 1-7 % slower (docs/benchmarks.md, "The all-or-nothing step's cost"). On a GPU
#: reading it would stall the host until the device caught up: there the writes fold it in. Tests set it to ``()``
#: to run the folded writes on a CPU.
ON_HOST: tuple[str, ...] = ("cpu",)


def gate(opt: Any, grads: list[tuple[str, torch.Tensor]], grad_scale: torch.Tensor | None,
     found_inf: torch.Tensor | None, world: int) -> Gate | None:
    """The step's skip flag (``commit.Gate``), or ``None`` where nothing can skip it (``nonfinite="propagate"``
    or ``"raise"`` on one process, without a scaler).

    The check: ``torch._amp_foreach_non_finite_check_and_unscale_`` over every gradient the rules read (local
    pieces under FSDP2 / TP, after a ``Partial()`` one is reduced), one call per device and dtype, flat in the
    model's depth; it unscales by ``1 / grad_scale`` in the same kernel where a ``GradScaler`` gives one. A
    scaler's ``found_inf`` adds to the flag. ``"raise"``: the flag read on the host (the one sync this mode
    makes, by choice) and, where set, the first non-finite parameter named, before anything is written. Under
    ``torch.distributed`` the flag exists in every mode: it also carries an error of any rank (:func:`agree`)."""
    scaler = grad_scale is not None or found_inf is not None
    check = opt._nonfinite != "propagate" or grad_scale is not None
    if not (check or scaler or world > 1):
        return None
    device = grads[0][1].device if grads else next(
        (local(p).device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
    found = torch.zeros((), dtype=torch.float32, device=device)
    if check and grads:
        by: dict[tuple, list[torch.Tensor]] = {}
        for _, g in grads:
            by.setdefault((g.device, g.dtype), []).append(g)
        inverse = None if grad_scale is None else grad_scale.double().reciprocal().float()
        flags: dict[torch.device, torch.Tensor] = {device: found}
        for (dev, _), gs in by.items():
            flag = flags.get(dev)
            if flag is None:
                flag = flags[dev] = torch.zeros((), dtype=torch.float32, device=dev)
            inv = (constant(opt._gate_constants, 1.0, torch.float32, dev) if inverse is None else
                   inverse.to(dev, non_blocking=True))
            torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, inv)
        for dev, flag in flags.items():
            if dev != device:
                found.add_(flag.to(device, non_blocking=True))
    if found_inf is not None:
        found.add_(found_inf.to(device=device, dtype=torch.float32, non_blocking=True))
    if opt._nonfinite == "raise" and not scaler:
        raise_nonfinite(opt, found, grads, world)
        if world == 1:
            return None
    return Gate(found, opt._gate_constants)


def raise_nonfinite(opt: Any, found: torch.Tensor, grads: list[tuple[str, torch.Tensor]], world: int) -> None:
    """``nonfinite="raise"``: read the flag (a host sync, by choice); where set, a ``RuntimeError`` naming the
    first parameter whose gradient holds a NaN or an infinity (the same on every rank: the flags are
    all-reduced first)."""
    pg = opt._process_group
    if world > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=pg)
    if not found.item():
        return
    bad = torch.stack([~torch.isfinite(g).all() for _, g in grads]).to(torch.float32)
    if world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=pg)
    name = grads[int(bad.nonzero()[0, 0])][0]
    raise RuntimeError(f"{type(opt).__name__}: the gradient of parameter {name!r} holds a NaN or an infinity; "
                       "nothing was written (nonfinite='raise'; nonfinite='skip' skips such a step instead)")


def agree(step: Commit, process_group: Any) -> None:
    """Under ``torch.distributed``: the ranks' one decision, an all-reduce (``MAX``) of the 0-D skip flag over the
    optimizer's process group, which carries a non-finite gradient of any rank's piece and an error of any rank
    (set here on the device: no host sync), so that no rank writes while another skips or raised."""
    flag = step.gate.flag
    if step.error is not None:
        flag.fill_(1.0)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)


def count_skipped(gate: Gate, counted: list[dict[str, Any]]) -> None:
    """Add the skip flag (0 or 1) to the ``"skipped_steps"`` of every parameter that had a gradient: one kernel
    per device."""
    by: dict[torch.device, list[torch.Tensor]] = {}
    for state in counted:
        t = state[SKIPPED]
        by.setdefault(t.device, []).append(t)
    for dev, ts in by.items():  # the List overload: the 0-D Tensor one reads the flag on the host (.item())
        torch._foreach_add_(ts, [gate.value(torch.int64, dev)] * len(ts))


def settle(step: Commit) -> None:
    """Where the step's flag lives on a device of :data:`ON_HOST`: read it (waiting for nothing there) and decide
    the writes now. Skipped: none is made (``step.skipped``; the gate is kept, :func:`count_skipped` counts it).
    Taken: the writes run ungated (``step.gate`` let go), the kernels of ``nonfinite="propagate"``. Elsewhere the
    flag stays on the device, folded into the writes."""
    gate = step.gate
    if gate is None or gate.flag.device.type not in ON_HOST:
        return
    if gate.flag.item():
        step.skipped = True
    else:
        step.gate = None


def decide(step: Commit, process_group: Any) -> None:
    """The step's decision once its directions exist: under ``torch.distributed`` (``process_group``) the ranks'
    agreement (:func:`agree`), then, on a CPU, the flag read (:func:`settle`)."""
    if process_group is not None:
        agree(step, process_group)
    settle(step)
