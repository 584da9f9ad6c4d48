"""``cuda_graph=True``: the batched step captured in one CUDA graph and replayed, one launch per step.

On a GPU a small model's optimizer step is launch-bound: Llama-60M's batched MeqMuon step launched
hundreds of kernels for 4 ms of work on an H200 (docs/benchmarks.md, GPU). Captured once in a
``torch.cuda.CUDAGraph`` (microsoft/dion#104's ``CudaGraphOptimizer`` captures its whole megabatched
step the same way), the step is one graph launch. What a capture bakes in must not change between
replays, so:

- **Hyperparameters a scheduler changes live on the device.** ``lr``, ``weight_decay`` and ``momentum`` of
  every param group, and AdamW's per-step ``-lr / (1 - beta1^t)`` and ``1 / sqrt(1 - beta2^t)``, are
  slots of one device tensor (:class:`Scalars`; float32, float64 where a parameter is float64); before
  ``replay()`` each ``step()`` writes the slots whose host value changed with one ``fill_`` each (the value
  travels as a kernel argument; a copy from pageable host memory may synchronise with the stream, CUDA's
  "API synchronization behavior"), as torch's own schedulers update a tensor ``lr``. The momentum rules run
  their ordinary batched (or compiled batched) form with those 0-D device tensors in place of the group's
  floats (:func:`device_group`); AdamW runs :func:`adamw_foreach`, its batched form with the step-dependent
  factors as device tensors.
- **Everything else is static, and a change re-captures.** The graph's key (:func:`graph_key`) is what the
  capture baked in: the parameters, their ``.grad`` tensors and the state tensors by address, which
  parameters have a gradient, every other hyperparameter's value, whether each group's weight decay is 0,
  and AdamW's step counts relative to each other. A step whose key differs runs eagerly once (the warm-up
  that ``torch.cuda.graph`` needs, on a side stream; it is that step's update) and captures anew.
  ``optimizer.zero_grad(set_to_none=False)`` keeps the gradients where they are; with ``set_to_none=True``
  (torch's default) the next backward allocates them afresh, usually at the same addresses (the caching
  allocator), and a moved gradient re-captures rather than reads stale memory. ``captures`` counts them.

Refused with one ``ValueError`` line (:func:`check`): a parameter off CUDA, a closure (it would run the
model between launches), a group with ``foreach=False`` (the per-tensor form is matrix by matrix, the
opposite of one launch), DTensor parameters and ``torch.distributed`` process groups (layouts whose step
makes host decisions or collectives), the capture hook (Python calls inside the step), and rules that
read per-step host counters (MuonEq's ``step`` state) or have no graph form (SCALE's rules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .calls import Item, StepContext
from .distributed import is_dtensor
from .driver import grads_like, make_buckets
from .rule import SteppingRule
from .rules import AdamW

__all__ = ["DYNAMIC", "GraphedStep", "Scalars", "adamw_foreach", "check", "device_group", "graph_key"]

#: Group hyperparameters held on the device (changed by schedulers without a re-capture).
DYNAMIC = ("lr", "weight_decay", "momentum")


class Scalars:
    """The host values a captured step reads, as slots of one ``dtype`` tensor on ``device``.

    ``dtype`` is the parameters' (float32, or float64 where one is float64; never narrower, where ``1 - lr wd``
    would round to 1): ``torch._foreach_mul_(tensors, scalar)`` and the like take their one-kernel path only
    where the 0-D ``scalar`` has the tensors' dtype, else they launch a kernel per tensor (an H100 ran 1,185
    kernels in the graphed Muon step at Llama-350M shapes, 34 against 28 ms eager, with float64 slots).

    A slot is asked for by key with the function that gives its current host value
    (:meth:`get`). Before the buffer exists (the warm-up run), :meth:`get` registers the key and returns a
    fresh 0-D tensor of the value; :meth:`freeze` then makes the buffer, after which :meth:`get` returns
    the slot's 0-D view (what a capture records) and :meth:`upload` writes the slots whose value changed.
    Every write is a ``fill_`` (the value a kernel argument), never a copy from host memory: a copy from
    pageable memory may wait for the stream (CUDA's "API synchronization behavior"), a host-device sync.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype = device, dtype
        self.keys: dict[Any, int] = {}
        self.values: list[Callable[[], float]] = []
        self.buffer: Tensor | None = None
        #: The host value each slot holds on the device (what :meth:`upload` compares with).
        self.held: list[float | None] = []

    def get(self, key: Any, value: Callable[[], float]) -> Tensor:
        """The 0-D device tensor of ``key``, whose host value is ``value()``."""
        if self.buffer is not None:
            return self.buffer[self.keys[key]]
        if key not in self.keys:
            self.keys[key] = len(self.values)
            self.values.append(value)
        return torch.full((), float(value()), dtype=self.dtype, device=self.device)

    def freeze(self) -> None:
        """Make the buffer (every slot registered so far) and fill it."""
        self.buffer = torch.empty(len(self.values), dtype=self.dtype, device=self.device)
        self.held = [None] * len(self.values)
        self.upload()

    def upload(self) -> int:
        """Every slot whose host value changed since it was written, one ``fill_`` each; returns how many."""
        written = 0
        for i, value in enumerate(self.values):
            v = float(value())
            if v != self.held[i]:
                self.buffer[i].fill_(v)
                self.held[i] = v
                written += 1
        return written


def device_group(group: dict, index: int, scalars: Scalars) -> dict:
    """``group`` with :data:`DYNAMIC` as 0-D device tensors (slots ``(index, key)``), for one step's forms;
    a weight decay of 0 stays the number 0 (no decay kernel; :func:`graph_key` holds which groups have 0)."""
    return {**group, **{k: scalars.get((index, k), lambda k=k: group[k]) for k in DYNAMIC
                        if k in group and not (k == "weight_decay" and float(group[k]) == 0.0)}}


def check(opt: Any, closure: Callable | None) -> None:
    """Raise ``ValueError`` (one line) where the step cannot be one captured graph; see the module's docstring."""
    where = "meqmuon: error: cuda_graph=True"
    if closure is not None:
        raise ValueError(f"{where} cannot capture step(closure): the closure runs the model between launches; "
                         "call loss.backward() and then step()")
    if opt._process_group is not None:
        raise ValueError(f"{where} runs one process's step; under torch.distributed build the optimizer without it")
    if opt._capture_hook is not None:
        raise ValueError(f"{where} cannot call the capture hook (Python inside the step); remove it first")
    for kind, rule in opt._rules.items():
        if isinstance(rule, SteppingRule) and not isinstance(rule, AdamW):
            raise ValueError(f"{where}: rule {rule.name!r} ({kind}) has no graph form")
        if any(how == "step" for how in getattr(rule, "state_views", {}).values()):
            raise ValueError(f"{where}: rule {rule.name!r} ({kind}) reads per-step host counters")
        if getattr(rule, "_own_inputs", False) or getattr(rule, "_own_step", False):
            # Muon-VS's bias correction reads the step count, MuonH's projection the lr: host values a capture bakes in
            raise ValueError(f"{where}: rule {rule.name!r} ({kind}) makes its own direction input or step from host "
                             "values (the step count, lr) that a captured graph would freeze")
    for group in opt.param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                raise ValueError(f"{where}: DTensor parameters (FSDP2/TP) need host decisions and collectives")
            if p.device.type != "cuda":
                raise ValueError(f"{where} needs CUDA parameters; one is on {p.device}")
    if not all(batched for _, _, batched in opt._plan()):
        raise ValueError(f"{where} captures the batched step; a group has foreach=False (per-tensor form)")


def graph_key(opt: Any) -> tuple:
    """What a capture bakes in (see the module's docstring); host values only, no sync."""
    key: list = [opt._compile]
    for group in opt.param_groups:
        key.append(tuple((k, repr(v)) for k, v in group.items() if k not in ("params", *DYNAMIC)))
        key.append(float(group.get("weight_decay", 0.0)) == 0.0)
        steps = []
        for p in group["params"]:
            g = p.grad
            st = opt.state.get(p, {})
            key.append((p.data_ptr(), None if g is None else (g.data_ptr(), g.dtype),
                        tuple(v.data_ptr() for v in st.values() if isinstance(v, Tensor))))
            if g is not None:  # the parameters that step: their counts move together
                steps.append(st.get("step", 0))
        key.append(tuple(s - steps[0] for s in steps) if steps else ())
    return tuple(key)


def adamw_foreach(rule: AdamW, items: Sequence[Item], group: dict, index: int, scalars: Scalars) -> None:
    """:meth:`AdamW.step_foreach` with the step-dependent factors as device tensors: ``lr``, ``weight_decay``
    and, per distinct step count ``t``, ``-lr / (1 - beta1^t)`` (``-lr sqrt(1 - beta2^t) / (1 - beta1^t)``
    with eps before the correction) and ``1 / sqrt(1 - beta2^t)``. The same maths; the division by
    ``sqrt(1 - beta2^t)`` becomes a product and ``addcdiv`` a division then a scaled add (rounding only)."""
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    for n, b in enumerate(make_buckets(items, matrix=False, transpose=False, by_shape=False)):
        params = [it.param for it in b.items]
        ms = [it.state["exp_avg"] for it in b.items]
        vs = [it.state["exp_avg_sq"] for it in b.items]
        grads = grads_like(b.items, ms)
        if float(group["weight_decay"]) != 0.0:  # the host value: part of the graph's key
            lr = scalars.get((index, "lr"), lambda: group["lr"])
            wd = scalars.get((index, "weight_decay"), lambda: group["weight_decay"])
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(vs)
        by_step: dict[int, list[int]] = {}
        for i, it in enumerate(b.items):
            by_step.setdefault(it.state["step"] - b.items[0].state["step"], []).append(i)
        for offset, members in by_step.items():
            def t(item=b.items[members[0]]):
                return item.state["step"]

            def step_size(t=t):
                c1, c2 = 1.0 - beta1 ** t(), 1.0 - beta2 ** t()
                return -float(group["lr"]) * (c2**0.5 if rule.eps_before_correction else 1.0) / c1

            size = scalars.get((index, "adamw", n, offset, "step_size"), step_size)
            ds = [denom[i] for i in members]
            if not rule.eps_before_correction:
                torch._foreach_mul_(ds, scalars.get((index, "adamw", n, offset, "bc2"),
                                                    lambda t=t: (1.0 - beta2 ** t()) ** -0.5))
            torch._foreach_add_(ds, eps)
            q = torch._foreach_div([ms[i] for i in members], ds)
            torch._foreach_mul_(q, size)
            torch._foreach_add_([params[i] for i in members], q)


class GraphedStep:
    """The step of an optimizer built with ``cuda_graph=True`` (``RoleOptimizer.step`` hands it over).

    ``capture=False`` runs the same body (device scalars, :func:`adamw_foreach`, the device groups) without
    a graph, on any device: the plumbing's CPU tests use it; the optimizer always captures.
    """

    def __init__(self, capture: bool = True) -> None:
        self.capture = capture
        self.key: tuple | None = None
        self.graph: Any = None
        self.scalars: Scalars | None = None
        self.stream: Any = None
        self.contexts: list[StepContext] = []
        self.workspace: dict = {}
        #: How many captures so far (a changed key re-captures; without a graph, how many keys).
        self.captures = 0

    def step(self, opt: Any, closure: Callable | None = None) -> None:
        """One step: count it, then replay the graph, or (a new key) run eagerly once and capture."""
        if self.capture:
            check(opt, closure)
        plan = opt._plan()  # creates the state of new parameters
        for _, entries, _ in plan:
            for e in entries:
                if e.param.grad is not None:
                    e.state["step"] += 1
        key = graph_key(opt)
        if key == self.key and self.scalars is not None:
            self.scalars.upload()
            if self.capture:
                self.graph.replay()
            else:
                self.body(opt, plan)
            return None
        self.key = None
        device = next(p.device for g in opt.param_groups for p in g["params"])
        wide = any(p.dtype == torch.float64 for g in opt.param_groups for p in g["params"])
        self.scalars = Scalars(device, torch.float64 if wide else torch.float32)
        self.captures += 1
        if not self.capture:
            self.body(opt, plan)
            self.scalars.freeze()
            self.key = key
            return None
        self.graph = None
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.body(opt, plan)  # the warm-up: this step's update, and the registration of every slot
        self.scalars.freeze()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.body(opt, plan)  # recorded, not run
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graph, self.key = graph, key
        return None

    def _context(self, i: int, kind: str) -> StepContext:
        while len(self.contexts) <= i:
            self.contexts.append(StepContext(workspace=self.workspace, call=len(self.contexts)))
        ctx = self.contexts[i]
        ctx.kind = kind
        return ctx

    def body(self, opt: Any, plan: list) -> None:
        """The step's kernels: per group and rule one call, the momentum rules in the optimizer's batched form
        (its chooser, ``RoleOptimizer._run``) with :func:`device_group`, AdamW in :func:`adamw_foreach`. Groups
        are not merged (the eager step merges equal ones into shared buckets): their values may part later."""
        calls = []
        for index, (group, entries, _) in enumerate(plan):
            by_rule: dict[Any, list[Item]] = {}
            for e in entries:
                g = e.param.grad
                if g is None:
                    continue
                if e.item is not None:
                    e.item.grad = g
                    by_rule.setdefault(e.rule, []).append(e.item)
                else:
                    by_rule.setdefault(e.rule, []).extend(e.items(g))
            for rule, items in by_rule.items():
                if isinstance(rule, SteppingRule):
                    adamw_foreach(rule, items, group, index, self.scalars)
                else:
                    kind = group.get("kind") or items[0].kind
                    calls.append((rule, items, device_group(group, index, self.scalars),
                                  self._context(len(calls), kind)))
        if calls:
            opt._run(([], calls))
        for _, entries, _ in plan:
            for e in entries:
                if e.item is not None:
                    e.item.grad = None

