"""What one optimizer step costs a rank: the bytes its collectives carry, the floor they are held to, the
tensors the optimizer keeps after the step, the step's transient allocations and its matmul FLOPs.

Shared by ``benchmarks/comm_bytes.py`` (real gloo runs at 2-4 ranks) and ``benchmarks/scale_sim.py``
(torch's fake process group at 8B-405B shapes), so that both measure with one instrument, whatever the
optimizer's code looks like inside (it reads nothing of ``meqmuon.optim`` but its public groups and
``memory``'s walk over what an optimizer holds, which the package's ``optimizer_held_bytes`` uses too):

- :class:`StepMeter`, a ``TorchDispatchMode`` (the mechanism of torch's own ``CommDebugMode``): it sees every
  ``torch.distributed`` collective (``c10d.*`` ops, which ``dist.all_to_all_single`` and friends dispatch to)
  and every functional collective (``_c10d_functional.*``: DTensor's ``redistribute`` and ``full_tensor``),
  also those DTensor issues inside its own dispatch (it steps aside for tensor subclasses, as
  ``CommDebugMode`` does). Per collective it counts the bytes of the buffers this rank sends and receives
  (an ``all_to_all_single``'s whole input and output, the share a rank keeps for itself included; an
  all-reduce's tensor once each way), also by the size of the group it runs on (HSDP's exchange should stay
  inside a shard group). It also counts matmul FLOPs (``2 m k n`` per product) and, as a counting
  allocator, the bytes of every storage an op creates while it is active, until that storage is freed
  (a ``weakref.finalize`` on the storage): ``peak`` is the most such bytes alive at once, on CPU, CUDA or
  ``meta`` alike (``meta`` storages have sizes but no memory). And, for a time model
  (``benchmarks/time_model.py``), the ops a step dispatches (views and allocations left out: they launch no
  kernel) and the bytes its non-matmul ops move through memory (:func:`op_traffic`, the rule of
  ``op_count.TrafficCounter``): the memory-bound work beside Newton-Schulz's FLOPs.
- :func:`floor_bytes`: what an exchange at the floor moves for this rank (issue 47): each local piece of a
  hidden matrix goes out once as Newton-Schulz input and its direction comes back once, in the Newton-Schulz
  dtype, ``2 x itemsize x local hidden elements``; nothing for a parameter whose view's matrices this rank
  holds whole (experts under EP or FSDP2's ``Shard(0)`` of a stack, ``Replicate()``). Under DDP (plain
  tensors, a process group of more than one rank initialised) each hidden direction is computed once and
  goes once to every other rank (issue 55): ``itemsize x hidden elements`` per rank, which is what a
  broadcast of every direction moves as the meter counts it (a broadcast's buffer sent by every rank, root or
  not); an exchange that sends each rank only the directions it owns, once to every other rank, stays under it.
- :func:`held_bytes`: the bytes of the distinct storages reachable from an optimizer object (its ``__dict__``,
  containers and slots, through DTensors to their local tensors), parameters and gradients excluded, split
  into its state (``opt.state``) and everything else (workspaces, whole copies, index maps). The walk is the
  package's (``meqmuon.optim.memory.held_tensors``, summed by ``optimizer_held_bytes``): one walk for the
  package and its instruments, checked against ``torch.optim.AdamW``'s state (``tests/test_scale_sim.py``).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meqmuon.optim.memory import optimizer_held_bytes, storage_key

__all__ = ["StepMeter", "floor_bytes", "held_bytes", "op_traffic", "storage_key", "tensor_bytes"]

#: The step's one decision under ``torch.distributed`` (issue 56): its skip flag, a 0-D float32 that carries a
#: non-finite gradient or an error of any rank, all-reduced once per step (``engine.RoleOptimizer._agree``), as
#: this meter counts it: 4 B sent, 4 B received, one ``allreduce_``.
AGREEMENT_BYTES = 4
AGREEMENT_CALLS = {"allreduce_": 1}

#: ``c10d`` ops (in-place on their arguments): op name -> (positions of the arguments sent, of those received).
C10D = {
    "allreduce_": ((0,), (0,)), "allreduce_coalesced_": ((0,), (0,)), "broadcast_": ((0,), (0,)),
    "allgather_": ((1,), (0,)), "_allgather_base_": ((1,), (0,)), "allgather_coalesced_": ((1,), (0,)),
    "allgather_into_tensor_coalesced_": ((1,), (0,)), "reduce_scatter_": ((1,), (0,)),
    "_reduce_scatter_base_": ((1,), (0,)), "reduce_scatter_tensor_coalesced_": ((1,), (0,)),
    "alltoall_base_": ((1,), (0,)), "alltoall_": ((1,), (0,)), "gather_": ((1,), (0,)), "scatter_": ((1,), (0,)),
    "send": ((0,), ()), "recv_": ((), (0,)), "reduce_": ((0,), (0,)),
}
#: ``_c10d_functional`` collectives (their first argument goes out, their result comes in); its other ops
#: (``wait_tensor``, ``_wrap_tensor_autograd``) move nothing.
FUNCTIONAL = frozenset({
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
    "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "broadcast_",
})
#: Matmul ops whose FLOPs are counted: op name -> FLOPs from the shapes of (first, second) operand.
MATMULS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2)}
#: Ops whose cost is FLOPs, not bytes (:func:`op_traffic` leaves them out).
FLOP_OPS = frozenset({*MATMULS, "matmul"})
#: Ops that allocate and launch nothing (``new_empty``'s tensor argument gives only its dtype and device: it reads
#: nothing).
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
#: Ops that the dispatcher sees but that run on the host alone: a dtype worked out (``torch.promote_types``), a
#: tensor pointed at another storage (``set_``), the profiler's marks (``torch.profiler.record_function``).
HOST_ONLY = frozenset({"promote_types", "set_", "_record_function_enter_new", "_record_function_exit"})


def tensor_bytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (a tensor, or nested lists/tuples of them), by their sizes."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(tensor_bytes(y) for y in x)
    return 0


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def launches(func) -> bool:
    """Whether an aten op launches a kernel: not a view, not an allocation, not the host's alone."""
    return not func.is_view and func.overloadpacket.__name__ not in ALLOCATIONS | HOST_ONLY


def op_traffic(func, args: tuple, kwargs: dict | None, out: Any) -> int:
    """The bytes an op moves through memory, for the memory-bound ops (not matmuls, views, allocations): every
    tensor argument read once, the result written once (``out=``: that tensor; an in-place op: its first
    argument). A lower bound of what a GPU kernel moves (no re-reads), the rule of ``op_count.TrafficCounter``:
    at Llama-350M shapes on an H100 its count put MeqMuon's 3.7 GB over Muon's at 1.1 ms, measured 1.9-2.2 ms
    (docs/benchmarks.md, Issue 49)."""
    name = func.overloadpacket.__name__
    if not launches(func) or name in FLOP_OPS:
        return 0
    kw = dict(kwargs or {})
    written = kw.pop("out", None)
    if written is None:
        written = args[0] if name.endswith("_") else out
    return tensor_bytes(args) + tensor_bytes(list(kw.values())) + tensor_bytes(written)


def _group_size(args: tuple) -> int | None:
    """The size of the process group a collective runs on: a ``c10d`` op's ProcessGroup argument, or a
    functional collective's group name (its last string argument)."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # a ReduceOp
                continue
    names = [a for a in args if isinstance(a, str)]
    return dist.distributed_c10d._resolve_process_group(names[-1]).size() if names else None


def _matmul_flops(name: str, args: tuple) -> int:
    a, b = (args[i] for i in MATMULS[name])
    batch = math.prod(a.shape[:-2]) if name in ("bmm", "baddbmm") else 1
    lead = a.shape[0] if name == "addbmm" else 1
    return 2 * batch * lead * a.shape[-2] * a.shape[-1] * b.shape[-1]


class StepMeter(TorchDispatchMode):
    """Counts, while active: collectives by name and the bytes this rank sends and receives in them
    (:attr:`calls`, :attr:`sent`, :attr:`received`, per name in :attr:`bytes_by_name`, per group size in
    :attr:`bytes_by_group_size`), matmul FLOPs
    (:attr:`flops`), the bytes of the storages created (:attr:`live` now, :attr:`peak` at most, from 0), the
    other ops that launch a kernel (:attr:`ops`, collectives apart) and the bytes the memory-bound ones move
    (:attr:`traffic`, :func:`op_traffic`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes_by_name: Counter = Counter()
        self.bytes_by_group_size: Counter = Counter()
        self.received_by_group_size: Counter = Counter()
        #: Calls and bytes per ``"name@group size"``: a block's collectives (``ns_group``) apart from the world's.
        self.calls_by_group: Counter = Counter()
        self.bytes_by_group: Counter = Counter()
        self.sent = self.received = self.flops = 0
        self.live = self.peak = 0
        self.ops = self.traffic = 0
        self._alive: dict[int, int] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def _track(self, outputs: Any, inputs: set[int]) -> None:
        for t in _tensors(outputs):
            if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._alive:
                continue
            nbytes = storage.nbytes()
            self._alive[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, nbytes)

    def _collective(self, namespace: str, name: str, args: tuple, out: Any) -> None:
        if namespace == "c10d" and name in C10D:
            sent_at, recv_at = C10D[name]
            sent = sum(tensor_bytes(args[i]) for i in sent_at)
            received = sum(tensor_bytes(args[i]) for i in recv_at)
        elif namespace == "_c10d_functional" and name in FUNCTIONAL:
            sent, received = tensor_bytes(args[0]), tensor_bytes(out)
        else:
            return
        self.calls[name] += 1
        self.sent += sent
        self.received += received
        self.bytes_by_name[name] += sent + received
        size = _group_size(args)
        self.bytes_by_group_size[size] += sent + received
        self.received_by_group_size[size] += received
        self.calls_by_group[f"{name}@{size}"] += 1
        self.bytes_by_group[f"{name}@{size}"] += sent + received

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return NotImplemented  # a DTensor: its own dispatch runs, and the ops on its locals come here
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "aten" and name in MATMULS:
            self.flops += _matmul_flops(name, args)
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        if namespace in ("c10d", "_c10d_functional"):
            self._collective(namespace, name, args, out)
        elif launches(func):
            self.ops += 1
            self.traffic += op_traffic(func, args, kwargs, out)
        self._track(out, inputs)
        return out

    def summary(self) -> dict[str, Any]:
        """The counts as plain values (for ``torch.save`` across processes)."""
        return {"calls": dict(self.calls), "sent": self.sent, "received": self.received, "flops": self.flops,
                "peak": self.peak, "bytes_by_name": dict(self.bytes_by_name),
                "bytes_by_group_size": dict(self.bytes_by_group_size), "calls_by_group": dict(self.calls_by_group),
                "received_by_group_size": dict(self.received_by_group_size),
                "bytes_by_group": dict(self.bytes_by_group), "ops": self.ops, "traffic": self.traffic}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the object it keeps, not a new alias), else ``t``."""
    return getattr(t, "_local_tensor", t)


def _whole_matrices(p: torch.Tensor, batch_dims: int) -> bool:
    """Whether this rank holds every matrix of ``p``'s view whole (only batch dimensions sharded)."""
    if not hasattr(p, "placements"):
        return True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return all(shape[d] == p.shape[d] for d in range(batch_dims, p.ndim))


def hidden_layouts(opt: torch.optim.Optimizer):
    """``(param, group, layout)`` of every hidden-kind parameter (``kind == "hidden"``, the Newton-Schulz kind
    of every Muon-family optimizer), its matrix view as ``views.group_layout`` reads it."""
    from meqmuon.optim.views import group_layout

    for group in opt.param_groups:
        if group.get("kind") != "hidden":
            continue
        names = group.get("names") or [f"params[{i}]" for i in range(len(group["params"]))]
        for i, (p, name) in enumerate(zip(group["params"], names, strict=True)):
            yield p, group, group_layout(group, i, p.shape, name)


def _shared(p: torch.Tensor) -> bool:
    """Whether ``p`` is a plain tensor whose Newton-Schulz the ranks of an initialised process group of more
    than one rank share (DDP: each computes some directions and sends them to every other rank)."""
    import torch.distributed as dist

    return (not hasattr(p, "placements") and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1)


def floor_bytes(opt: torch.optim.Optimizer, itemsize: int) -> int:
    """Bytes per step a rank's exchange at the floor moves (see the module docstring), per element of every
    hidden-kind parameter (``kind == "hidden"``, the Newton-Schulz kind of every Muon-family optimizer):
    ``2 x itemsize`` per local element of a DTensor whose view's matrices this rank does not hold whole (out
    once, back once); ``itemsize`` per element of a plain tensor under DDP (each direction once to every other
    rank, a broadcast's buffer counted as sent by every rank, as :class:`StepMeter` counts it); nothing for the
    rest. ``itemsize``: of the Newton-Schulz dtype."""
    total = 0
    for p, _, layout in hidden_layouts(opt):
        if _shared(p):
            total += itemsize * p.numel()
        elif not _whole_matrices(p, len(layout.batch)):
            total += 2 * itemsize * _local(p).numel()
    return total


def held_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the distinct storages the optimizer object holds, parameters and gradients excluded:
    ``state`` (reachable from ``opt.state``), ``other`` (reachable from ``opt`` but not from its state),
    ``total``; and ``params`` (the local bytes of its parameters, for scale). The walk is
    ``meqmuon.optim.memory.held_tensors``, summed by ``optimizer_held_bytes``."""
    held = optimizer_held_bytes(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"state": held["state"], "other": held["other"], "total": held["state"] + held["other"],
            "params": sum(_local(p).numel() * p.element_size() for p in params)}
