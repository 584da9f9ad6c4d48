"""meqmuon in PyTorch Lightning (docs/lightning.md), where ``lightning`` is installed (the ``dev`` extra has it).

A ``LightningModule`` whose ``configure_optimizers`` returns ``meqmuon.build_optimizer(...)`` and a per-step
``LambdaLR``, trained by Lightning's own ``Trainer`` on CPU: one process; ``DDPStrategy`` on 2 gloo processes;
``ModelParallelStrategy`` on 2 processes with FSDP2 (``fully_shard`` over its ``data_parallel`` mesh) and with
tensor parallelism (``parallelize_module`` over its ``tensor_parallel`` mesh: colwise ``q``/``up``, rowwise
``k``/``down``, vocabulary-parallel embedding and head). Each ends where one process ends, to 1e-6 (float32
Newton-Schulz, 6 updates, the same samples per update: DDP's and FSDP2's 2 ranks of 4 sequences, TP's 2 ranks
of the same 8, against one process's 8). A run resumed from the checkpoint Lightning's ``ModelCheckpoint``
wrote after update 3 (``ckpt_path``; under ModelParallelStrategy a DCP directory), into a model of another
initialisation, ends bit for bit as the uninterrupted one.

The distributed runs are this file run as a script under ``torch.distributed.run`` (Lightning sees the
launcher's environment and starts no processes of its own): one launch runs the three strategies in turn.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import _free_port
from torch import nn

import meqmuon

try:
    import lightning as L
except ImportError as e:
    L = None
    WHY = f"lightning does not import ({e}); pip install 'meqmuon[lightning]'"

pytestmark = pytest.mark.skipif(L is None, reason=WHY if L is None else "")

#: 2 epochs of 3 updates of 8 sequences of 9 tokens over a vocabulary of 24; a checkpoint after each epoch
STEPS, EPOCH, BATCH, VOCAB = 6, 3, 8, 24
TOLERANCE = 1e-6


def _data(replicas: int = 1) -> torch.utils.data.DataLoader:
    """The 24 sequences in order, 8 an update, split over ``replicas`` data-parallel ranks (this rank's share:
    its own ``DistributedSampler``, unshuffled, since Lightning's would shuffle them, ``use_distributed_sampler``)."""
    ids = torch.randint(0, VOCAB, (EPOCH * BATCH, 9), generator=torch.Generator().manual_seed(1))
    sampler = None
    if replicas > 1:
        sampler = torch.utils.data.DistributedSampler(ids, replicas, int(os.environ["RANK"]), shuffle=False)
    return torch.utils.data.DataLoader(ids, batch_size=BATCH // replicas, sampler=sampler)


class Block(nn.Module):
    """A pre-norm attention-free block: embedding, two residual two-matrix maps (``q``, ``k``; ``up``, ``down``),
    a norm, a head: every parameter kind, and each hidden matrix one TP can shard."""

    def __init__(self, vocab: int = VOCAB, d: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        h = h + self.k(torch.tanh(self.q(h)))
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _module(parallel: str | None = None, seed: int = 0):
    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.model = Block()

        def configure_model(self) -> None:  # ModelParallelStrategy: the parallelism is applied here
            if parallel == "fsdp":
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
            elif parallel == "tp":  # torchtitan's plan: colwise in, rowwise out, vocabulary-parallel ends
                from torch.distributed.tensor import Replicate
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                plan = {"q": ColwiseParallel(), "k": RowwiseParallel(), "up": ColwiseParallel(),
                        "down": RowwiseParallel(),
                        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                        "lm_head": ColwiseParallel(output_layouts=Replicate())}
                parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return _loss(self.model, batch)

        def configure_optimizers(self):
            opt = meqmuon.build_optimizer("meqmuon", self.model, lr=2e-2, ns_dtype=torch.float32)
            warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return Tiny()


def _trainer(strategy="auto", devices: int = 1, folder: Path | None = None) -> L.Trainer:
    """Lightning's Trainer, 6 updates; with ``folder``, Lightning's ``ModelCheckpoint`` at each epoch's end."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_epoch = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=EPOCH,
                                  save_top_k=-1) if folder else None
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                     use_distributed_sampler=False,
                     callbacks=[every_epoch] if every_epoch else [], enable_checkpointing=every_epoch is not None,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder)


def _params(module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.model.named_parameters()}


def _fit(strategy, devices: int, replicas: int, parallel: str | None, folder: Path) -> dict[str, dict]:
    """6 updates, checkpointed at the end of each epoch of 3; then a model of another initialisation resumed
    from the first checkpoint (``ckpt_path``) to the same 6."""
    done = _module(parallel)
    _trainer(strategy(), devices, folder).fit(done, _data(replicas))
    resumed = _module(parallel, seed=1)
    _trainer(strategy(), devices).fit(resumed, _data(replicas), ckpt_path=folder / f"step={EPOCH}.ckpt")
    return {"done": _params(done), "resumed": _params(resumed)}


def _strategies() -> dict:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    return {"ddp": (lambda: DDPStrategy(process_group_backend="gloo"), None),
            "fsdp2": (lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), "fsdp"),
            "tp": (lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), "tp")}


def test_one_process_and_resume(tmp_path):
    torch.set_num_threads(1)
    out = _fit(lambda: "auto", 1, 1, None, tmp_path)
    for n, p in out["done"].items():
        assert torch.equal(p, out["resumed"][n]), n
    assert not torch.equal(out["done"]["q.weight"], _module().model.q.weight)  # it trained


def test_ddp_and_model_parallel_equal_one_process(tmp_path):
    """DDP, FSDP2 and TP under Lightning on 2 gloo processes: each equals one process to 1e-6, and each resumes
    bit for bit from its own checkpoint."""
    torch.set_num_threads(1)
    reference = _fit(lambda: "auto", 1, 1, None, tmp_path)["done"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           __file__, str(tmp_path)]  # not port 0: Lightning's ranks then wait for each other for ever
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for name in _strategies():
        out = torch.load(tmp_path / f"{name}.pt")
        for n, p in reference.items():
            diff = (out["done"][n] - p).abs().max().item()
            assert diff <= TOLERANCE, (name, n, diff)
            assert torch.equal(out["done"][n], out["resumed"][n]), (name, n)


if __name__ == "__main__":  # a rank of torch.distributed.run: the three strategies in turn
    torch.set_num_threads(1)
    folder = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    for name, (strategy, parallel) in _strategies().items():
        # DDP and FSDP2 give each rank half of the 8 sequences of an update; TP ranks see all 8
        out = _fit(strategy, 2, 1 if parallel == "tp" else 2, parallel, folder / name)
        if rank == 0:
            torch.save(out, folder / f"{name}.pt")
    # End as every worker of the suite ends: gloo's threads stopped first, then no interpreter teardown (under load a
    # rank's exit aborted once in CI with "terminate called without an active exception", SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os._exit(0)
