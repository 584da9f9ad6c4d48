"""Opt-in capture of the matrices the paper's section 3.1 analyses, at chosen training steps.

What is saved (paper section 3.1):

- hidden matrices (``kind == "hidden"``) of the chosen Transformer layers: the *pre-Newton-Schulz*
  matrix, i.e. the direction input ``G_t + mu B_t`` (Nesterov) or ``B_t`` that the optimizer hands
  to ``Orth`` (eq. 3). Muon's update ``U_t = Orth(.)`` (eq. 2) is recomputed from it offline, so one
  capture serves Tables 1, 4, 8-10 and the NS replay of Figure 1.
- the token embedding and LM head (``kind in {"embedding", "head"}``): their *unorthogonalised
  momentum* (Table 3). Under MeqMuon-type rules the optimizer keeps that momentum and the hook
  receives the direction input that enters eq. 9. Under AdamW-type rules (Muon, NorMuon) there is
  no momentum buffer, only the raw gradient, so the recorder accumulates ``B_t = mu B_{t-1} + G_t``
  (eq. 6, ``mu = 0.95``) itself, as the paper did ("we separately accumulate unorthogonalised
  momentum matrices").

Cost: nothing is installed when no step is requested. Otherwise the hook returns immediately for
hidden and vector parameters outside capture steps; the only per-step work is the momentum
accumulation just described, for embedding/head gradients only, from step 1 up to the last capture
step (one ``mul_`` + ``add_`` and one extra float32 buffer of the embedding/head size on the
parameter's device, e.g. 2 x 32000 x 1024 x 4 B = 250 MiB for Llama-350M). After the last capture
step the hook is removed and the buffers are freed.

Files: ``out_dir/captures/step_{k}.pt``, a dict
``{"step": k, "optimizer": str, "tensors": {name: float32 CPU tensor}, "kinds": {name: kind},
"sources": {name: "pre_ns" | "momentum" | "accumulated_momentum"}, "momentum_steps": {name: int}}``,
loadable with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["CaptureRecorder", "CAPTURE_MOMENTUM", "layer_index", "capture_path"]

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
#: Momentum coefficient of the self-accumulated momentum (paper section 4: mu = 0.95).
CAPTURE_MOMENTUM = 0.95


def layer_index(name: str) -> int | None:
    """Transformer layer of a parameter name, e.g. ``model.layers.4.self_attn.q_proj.weight`` -> 4."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def capture_path(run_dir: str | Path, step: int) -> Path:
    """Where the capture of ``step`` lives inside a run directory."""
    return Path(run_dir) / "captures" / f"step_{int(step)}.pt"


class CaptureRecorder:
    """Records pre-NS hidden matrices and embedding/head momentum at chosen steps (see module docstring).

    Contract with the training loop::

        rec = CaptureRecorder(run_dir, steps=[10, 20], layers=[0, 1])
        rec.attach(opt)
        for step in range(1, n + 1):        # 1-based update index
            ...backward...
            rec.begin_step(step); opt.step(); rec.end_step()

    Args:
        out_dir: run directory; files go to ``out_dir/captures``.
        steps: 1-based update indices to capture. Empty: the recorder never installs its hook.
        layers: Transformer layers whose hidden matrices are kept; ``None`` keeps every layer
            (and hidden matrices without a layer index).
        momentum: ``mu`` for the self-accumulated embedding/head momentum of AdamW-ruled params.
    """

    def __init__(
        self,
        out_dir: Path,
        steps: Iterable[int],
        layers: Iterable[int] | None = None,
        *,
        momentum: float = CAPTURE_MOMENTUM,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.steps = frozenset(int(s) for s in steps)
        if any(s < 1 for s in self.steps):
            raise ValueError(f"CaptureRecorder: steps are 1-based update indices, got {sorted(self.steps)}")
        self.layers = None if layers is None else frozenset(int(i) for i in layers)
        self.momentum = float(momentum)
        self.last_step = max(self.steps, default=0)
        self.written: list[Path] = []
        self._optimizer: Any = None
        self._step: int | None = None
        self._capturing = False
        self._tensors: dict[str, Tensor] = {}
        self._kinds: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        # Self-accumulated momentum of embedding/head gradients (AdamW-ruled kinds): name -> B.
        self._momentum: dict[str, Tensor] = {}
        self._momentum_steps: dict[str, int] = {}

    @property
    def active(self) -> bool:
        """Whether the hook is currently installed."""
        return self._optimizer is not None

    def attach(self, optimizer: Any) -> None:
        """Install the capture hook on ``optimizer`` (a no-op when there is nothing to capture)."""
        if not self.steps:
            return
        if not hasattr(optimizer, "set_capture_hook"):
            warnings.warn(
                f"CaptureRecorder: {type(optimizer).__name__} has no set_capture_hook (only meqmuon optimizers do); "
                "nothing will be captured.",
                UserWarning,
                stacklevel=2,
            )
            return
        self._optimizer = optimizer
        optimizer.set_capture_hook(self._hook)

    def begin_step(self, step: int) -> None:
        """Called before ``optimizer.step()`` with the 1-based update index."""
        self._step = int(step)
        self._capturing = self._step in self.steps

    def end_step(self) -> None:
        """Called after ``optimizer.step()``: writes the capture file of a capture step."""
        if self._capturing and self._step is not None:
            self._write(self._step)
        self._capturing = False
        if self._optimizer is not None and self._step is not None and self._step >= self.last_step:
            self.detach()

    def detach(self) -> None:
        """Remove the hook and free the accumulated momentum (done automatically after the last step)."""
        if self._optimizer is not None:
            self._optimizer.set_capture_hook(None)
            self._optimizer = None
        self._momentum.clear()
        self._momentum_steps.clear()

    # ---- hook --------------------------------------------------------------------------------

    def _wants_hidden(self, name: str) -> bool:
        if self.layers is None:
            return True
        layer = layer_index(name)
        return layer is not None and layer in self.layers

    def _hook(self, name: str, kind: str, what: str, tensor: Tensor) -> None:
        if kind in ("embedding", "head"):
            if what == "gradient":
                # Muon/NorMuon give these params to AdamW: accumulate B = mu B + G every step (eq. 6).
                buf = self._momentum.get(name)
                g = tensor.detach().to(torch.float32)
                if buf is None:
                    buf = self._momentum[name] = torch.zeros_like(g)
                buf.mul_(self.momentum).add_(g)
                self._momentum_steps[name] = self._momentum_steps.get(name, 0) + 1
                if self._capturing:
                    self._keep(name, kind, "accumulated_momentum", buf)
            elif what == "momentum_input" and self._capturing:
                self._keep(name, kind, "momentum", tensor)
            return
        if not self._capturing or kind != "hidden" or what != "momentum_input":
            return
        if self._wants_hidden(name):
            self._keep(name, kind, "pre_ns", tensor)

    def _keep(self, name: str, kind: str, source: str, tensor: Tensor) -> None:
        # The tensor is the optimizer's own buffer and changes next step: keep a float32 CPU copy.
        x = tensor.detach()
        if x.ndim > 2:
            x = x.reshape(x.shape[0], -1)  # the matrix view the optimizer orthogonalises
        self._tensors[name] = x.to(device="cpu", dtype=torch.float32, copy=True)
        self._kinds[name] = kind
        self._sources[name] = source

    def _write(self, step: int) -> None:
        path = capture_path(self.out_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "step": step,
            "optimizer": type(self._optimizer).__name__ if self._optimizer is not None else "",
            "tensors": dict(self._tensors),
            "kinds": dict(self._kinds),
            "sources": dict(self._sources),
            "momentum_steps": {n: self._momentum_steps[n] for n in self._tensors if n in self._momentum_steps},
        }
        torch.save(payload, path)
        self.written.append(path)
        self._tensors.clear()
        self._kinds.clear()
        self._sources.clear()
