"""Stopping a run cleanly on SIGINT / SIGTERM (Ctrl-C, or a cluster scheduler's notice before preemption).

While the training loop runs, :class:`StopSignals` replaces the handlers of SIGINT and SIGTERM by one
that only records the signal. The loop reads the record at the end of every update: it finishes that
update, writes a checkpoint (atomic, :mod:`meqmuon.train.checkpoint`), logs a ``{"kind": "stop"}``
record and raises :class:`RunInterrupted`, which the command turns into one line saying how to resume
(``--resume auto``) and exit status ``128 + signal`` (130 for SIGINT, 143 for SIGTERM), the shell's
convention for a process ended by a signal. A second signal exits at once (status ``128 + signal``,
no checkpoint): the user or the scheduler insists.

Under ``torchrun`` every rank must save the same step, but a signal may reach one rank only (a
scheduler that signals one process, a ``kill`` of one worker) or reach them at different updates.
The ranks therefore agree through the all-reduce the loop already makes every update (the mean
loss): the flag travels in the same tensor, summed, so one rank's signal stops all of them after
the same update, with no extra collective and no host synchronisation in the optimizer step.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["RunInterrupted", "StopSignals", "SIGNALS"]

#: The signals that stop a run cleanly.
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """A run stopped by a signal after a clean checkpoint; ``exit_status`` is ``128 + signal``."""

    def __init__(self, signum: int, step: int, steps: int, run_dir: Path, checkpoint: Path | None):
        self.signum, self.step, self.steps = signum, step, steps
        self.run_dir, self.checkpoint = Path(run_dir), checkpoint
        self.signal_name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint is not None else f"checkpoint in {self.run_dir}"
        super().__init__(f"stopped by {self.signal_name} after step {step} of {steps} ({where})")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager: SIGINT/SIGTERM set :attr:`signum` instead of ending the process; a second one
    ends it at once with status ``128 + signal``. Outside the main thread (where Python cannot install
    handlers) it does nothing, and the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # os.write and os._exit are safe inside a signal handler; a print could re-enter a stream.
        os.write(2, f"meqmuon: second {signal.Signals(signum).name}: exiting at once without saving\n".encode())
        os._exit(128 + signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
