"""How long is the path of one optimizer step through the code: functions, files and moves.

Usage::

    python benchmarks/flow.py                      # the table for MeqMuon, Muon and torch's Muon
    python benchmarks/flow.py --list meqmuon       # + the functions one row enters, in call order
    python benchmarks/flow.py --layouts            # MeqMuon per tensor under DDP, FSDP2 and TP (2 gloo ranks)

A reader follows an update by reading the functions it enters; each move from one file to another is a
page turned. ``sys.setprofile`` sees every Python call and return of the second ``opt.step()`` (the first
also creates state) on a model of two hidden matrices, ``(128, 64)`` and ``(64, 128)`` (the batched step
puts them in one Newton-Schulz bucket, one of them transposed), and on a tiny language model with every
parameter kind (embedding, head, hidden, vector: :class:`TinyLM`). Counted are the functions whose code
lives in the package (``meqmuon/``; for ``torch.optim.Muon``, ``torch/optim/``), not
comprehensions, generator expressions or lambdas:

- functions: distinct functions entered;
- files: distinct files they live in;
- moves: along the stream of counted calls (the callee's file) and returns (the caller's file, when
  the caller is counted too), the number of times the file changes.

``--layouts`` counts rank 0's second MeqMuon step (per tensor, float32 Newton-Schulz) of the two-matrix model on
2 gloo ranks as torch lays it out: DDP (plain tensors, the process group initialised), FSDP2 (``fully_shard`` of
each layer) and TP (``parallelize_module``: the first layer colwise, the second rowwise), beside one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

import meqmuon

#: Code names that are not functions a reader reads as such.
ANONYMOUS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"}
SHAPES = [(128, 64), (64, 128)]


def _root(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


class Flow:
    """A ``sys.setprofile`` recorder of the functions, files and file-to-file moves under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.functions: dict[tuple[str, int, str], None] = {}
        self.stream: list[str] = []

    def _counted(self, frame) -> bool:
        code = frame.f_code
        return code.co_filename.startswith(self.root) and code.co_name not in ANONYMOUS

    def __call__(self, frame, event, arg) -> None:
        if event == "call" and self._counted(frame):
            code = frame.f_code
            self.functions[(code.co_filename, code.co_firstlineno, code.co_qualname)] = None
            self.stream.append(code.co_filename)
        elif event == "return" and self._counted(frame) and frame.f_back is not None \
                and self._counted(frame.f_back):
            self.stream.append(frame.f_back.f_code.co_filename)

    @property
    def files(self) -> set[str]:
        return {f for f, _, _ in self.functions}

    @property
    def moves(self) -> int:
        return sum(a != b for a, b in zip(self.stream, self.stream[1:], strict=False))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(i, o, bias=False) for o, i in SHAPES])


class TinyLM(nn.Module):
    """A language model with every parameter kind: an embedding, two hidden matrices (one transposable onto
    the other), a norm's vector and an untied head."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        h = h + self.down_proj(torch.relu(self.up_proj(h)))
        return self.lm_head(self.norm(h))


def _loss(m: nn.Module) -> torch.Tensor:
    if isinstance(m, TinyLM):
        ids = torch.arange(32).remainder(64).reshape(2, 16)
        return nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    return m(torch.randn(8, SHAPES[0][1])).square().mean()


def profile(make_opt: Callable[[nn.Module], torch.optim.Optimizer], root: str, lm: bool = False) -> Flow:
    """The flow of the second ``step()`` of ``make_opt(model)`` (``lm``: of :class:`TinyLM`)."""
    m = TinyLM() if lm else model()
    opt = make_opt(m)
    for i in range(2):
        opt.zero_grad()
        _loss(m).backward()
        flow = Flow(root)
        if i == 1:
            sys.setprofile(flow)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
    return flow


def rows() -> dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], str, bool]]:
    """Row label -> (optimizer factory, package root, on the tiny LM)."""
    ours = _root(meqmuon)
    out = {}
    for lm in (False, True):
        for name, cls in (("MeqMuon", meqmuon.MeqMuon), ("Muon", meqmuon.Muon)):
            for form, foreach in (("per-tensor", False), ("batched", True)):
                out[f"{name}, {form}" + (", tiny LM" if lm else "")] = (
                    lambda m, c=cls, f=foreach: c(meqmuon.param_groups(m), lr=1e-2, foreach=f,
                                                  ns_dtype=torch.float32), ours, lm)
    if hasattr(torch.optim, "Muon"):
        out["torch.optim.Muon"] = (lambda m: torch.optim.Muon(m.parameters(), lr=1e-2), _root(torch.optim), False)
    return out


LAYOUTS = ("one process", "DDP", "FSDP2", "TP")


def _layout_flow(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2: the flow of MeqMuon's second per-tensor step under each of :data:`LAYOUTS`; rank 0
    saves the counts to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    layouts = {"DDP": lambda m: None, "FSDP2": lambda m: [fully_shard(layer, mesh=mesh) for layer in m],
               "TP": lambda m: parallelize_module(m, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})}
    counts = {}
    for label, lay in layouts.items():
        def make(m, lay=lay):
            lay(m)
            return meqmuon.MeqMuon(meqmuon.param_groups(m), lr=1e-2, foreach=False, ns_dtype=torch.float32)
        torch.manual_seed(0)  # the same input on both ranks
        flow = profile(make, _root(meqmuon))
        counts[label] = (len(flow.functions), len(flow.files), flow.moves)
    if rank == 0:
        torch.save(counts, out)
    dist.destroy_process_group()
    os._exit(0)


def layouts() -> dict[str, tuple[int, int, int]]:
    """Functions, files and moves of MeqMuon's per-tensor step per layout (2 gloo ranks, rank 0)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.pt")
        mp.spawn(_layout_flow, args=(port, out), nprocs=2)
        counts = torch.load(out)
    one = profile(lambda m: meqmuon.MeqMuon(meqmuon.param_groups(m), lr=1e-2, foreach=False,
                                            ns_dtype=torch.float32), _root(meqmuon))
    return {"one process": (len(one.functions), len(one.files), one.moves), **counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", metavar="ROW", help="also list the functions of rows whose label contains ROW")
    ap.add_argument("--layouts", action="store_true", help="MeqMuon per tensor under DDP, FSDP2 and TP instead")
    args = ap.parse_args(argv)
    if args.layouts:
        print("| MeqMuon, per tensor, rank 0 of 2 | functions | files | moves |\n|---|---:|---:|---:|")
        for label, (functions, files, moves) in layouts().items():
            print(f"| {label} | {functions} | {files} | {moves} |")
        return 0
    print("| step | functions | files | moves |\n|---|---:|---:|---:|")
    flows = {label: profile(make, root, lm) for label, (make, root, lm) in rows().items()}
    for label, flow in flows.items():
        print(f"| `{label}` | {len(flow.functions)} | {len(flow.files)} | {flow.moves} |")
    for label, flow in flows.items():
        if args.list and args.list.lower() in label.lower():
            print(f"\n{label}:")
            for file, line, qualname in flow.functions:
                print(f"  {os.path.relpath(file)}:{line} {qualname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
