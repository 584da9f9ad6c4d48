"""Sharding the harness's model with torch's own parallel APIs: ``--fsdp`` and ``--tp N``.

``--tp N`` applies torchtitan's tensor-parallel plan (``torchtitan/models/llama3/infra/parallelize.py``)
to the six paper models (Llama and Qwen2 in transformers): q/k/v/gate/up colwise, o/down rowwise, on
the ``tp`` dimension of a DeviceMesh; the token embedding (rows: the vocabulary) and the LM head
(colwise: the vocabulary) are vocabulary-parallel where that is exact: an untied model whose
vocabulary ``N`` divides. ``--fsdp`` applies FSDP2 (``fully_shard``) per decoder layer and to the root
over the data-parallel (``dp``) dimension (stacked MoE experts on their dimension 1 where ``dp`` exceeds their
number, :func:`expert_placement`), with bf16 parameters for the forward and backward and
float32 gradient reduction when the run's precision is bf16. The mesh is ``(dp, tp)`` with
``dp = world / N``; without ``--fsdp`` the ranks must all be tensor-parallel (``N`` = world size):
DDP over DTensor parameters is not something torch offers.

The data follow the ``dp`` coordinate: the ranks of one TP group read the same micro-batches.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Layout", "check_layout", "expert_placement", "gathered_logits_view", "shard_model"]


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout: ``world = dp x tp`` ranks, this rank at ``(dp_rank, tp_rank)``."""

    world: int
    tp: int
    fsdp: bool
    rank: int

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors (checkpoints through ``torch.distributed.checkpoint``)."""
        return self.fsdp or self.tp > 1

    def describe(self) -> str:
        """The layout and its sizes in words (the run's first log line): ``1 process``, ``DDP over 4
        ranks``, ``FSDP2 over 4 ranks``, ``TP over 2 ranks``, ``FSDP2 2 x TP 2 (4 ranks)``."""
        if self.world == 1:
            return "1 process"
        if self.fsdp and self.tp > 1:
            return f"FSDP2 {self.dp} x TP {self.tp} ({self.world} ranks)"
        kind = "FSDP2" if self.fsdp else "TP" if self.tp > 1 else "DDP"
        return f"{kind} over {self.world} ranks"


def check_layout(world: int, tp: int, fsdp: bool, config: Any | None = None) -> None:
    """One clear ``ValueError`` line for a layout the run cannot have (before anything is built)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if (fsdp or tp > 1) and world == 1:
        raise ValueError("--fsdp and --tp shard over ranks: launch with torchrun --nproc_per_node N (N >= 2)")
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} ranks (world size must be a multiple of --tp)")
    if tp > 1 and world > tp and not fsdp:
        raise ValueError(f"--tp {tp} on {world} ranks leaves {world // tp} data-parallel groups: add --fsdp to shard "
                         f"them (DDP over tensor-parallel parameters is not supported), or use --tp {world}")
    if config is None or tp == 1:
        return
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, name, None)
        if n is not None and n % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {name} ({n}); choose a --tp that does")


def expert_placement(shards: int) -> Callable[[torch.nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn`` for ``shards`` ranks as torchtitan chooses it: a stack of experts (a 3-D
    parameter, transformers 5's MoE layout ``(E, ., .)``) on its dimension 1 where there are more ranks than experts,
    every other parameter on FSDP2's default dimension 0 (``None``). On dimension 0 the ranks past the ``E``-th would
    hold no expert at all and the first ``E`` every expert's whole matrices: torchtitan's ``apply_fsdp``
    (``torchtitan/models/llama4/infra/parallelize.py`` at 2645c02: "when dp_mod_ep * ep > num_experts, FSDP default
    dim-0 sharding causes inefficiency, so we choose to do FSDP sharding on dim-1")."""
    from torch.distributed.tensor import Shard

    def placement(p: torch.nn.Parameter) -> Any:
        return Shard(1) if p.ndim == 3 and p.shape[0] < shards else None

    return placement


def _vocab_parallel(model: torch.nn.Module, tp: int) -> bool:
    """Vocabulary-parallel embedding and head: exact for an untied model whose vocabulary ``tp`` divides."""
    cfg = model.config
    return not cfg.tie_word_embeddings and cfg.vocab_size % tp == 0


def vocab_plan(model: torch.nn.Module, mesh: Any) -> None:
    """The embedding rowwise and the head colwise over the vocabulary on ``mesh``, where that is exact
    (:func:`_vocab_parallel`): the first part of torchtitan's TP plans."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if _vocab_parallel(model, mesh.size()):
        parallelize_module(model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })


def tp_plan(model: torch.nn.Module, mesh: Any) -> None:
    """torchtitan's Llama TP plan on a transformers Llama/Qwen2 causal LM (``model.model.layers``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    vocab_plan(model, mesh)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })


@contextlib.contextmanager
def gathered_logits_view(model: torch.nn.Module, layout: Layout | None) -> Iterator[None]:
    """The forward pass of a training step under FSDP2 over a vocabulary-parallel head, without one warning.

    The LM head's colwise output is all-gathered over the vocabulary (``output_layouts=Replicate()``),
    and the gathered logits are a view; FSDP2's root then warns, once per process, that an in-place op
    on a view its forward returns "can cause backward to fail or produce wrong gradients" (torch's
    ``_fsdp_state._register_pre_backward_hook``). Its concern is an in-place op that would drop the
    pre-backward hook; the harness's loss (:func:`meqmuon.train.evaluate.causal_lm_loss`) reads the
    logits out of place only (``.float()``, ``reshape``, ``cross_entropy``), and the 4-process
    ``--fsdp --tp 2`` run matches one process to 1e-7 (tests/test_train_parallel.py). So that message,
    and only it, is ignored here, and only for this layout; everywhere else it still shows.
    """
    if layout is None or not (layout.fsdp and layout.tp > 1 and _vocab_parallel(model, layout.tp)):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"FSDP2-wrapped module \(FSDP\w+ForCausalLM\) returned a view tensor")
        yield


def shard_model(model: torch.nn.Module, layout: Layout, precision: str, device: torch.device) -> Any:
    """Shard ``model`` in place for ``layout``; returns the DeviceMesh (``None`` for an unsharded layout)."""
    if not layout.sharded:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_layout(layout.world, layout.tp, layout.fsdp, model.config)
    mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    if layout.dp > 1 and layout.tp > 1:
        # FSDP2 over TP: a norm of a weight sharded on both dimensions (the gradient norm of every update)
        # is a partial sum on both; with a flattened (dp, tp) dimension DTensor reduces it in one all-reduce,
        # not two in sequence (torch warns about those: "2 sequential all_reduce operations"). torchtitan
        # flattens its meshes the same way (``_flatten``; torch has no public name for it yet).
        mesh._flatten("dp_tp")
    if layout.tp > 1:
        tp_plan(model, mesh["tp"])
    if layout.fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        placement = expert_placement(layout.dp)
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp, shard_placement_fn=placement)
    return mesh
