"""meqmuon: MeqMuon (Matrix-Equilibrating Muon) and faithful Muon-family baselines for LLM pretraining.

Quick start::

    import meqmuon
    groups = meqmuon.param_groups(model)      # hidden / embedding / head / vector, by role
    opt = meqmuon.MeqMuon(groups, lr=2e-3)    # or Muon / NorMuon / Scale on the same groups
    # or: opt = meqmuon.build_optimizer("meqmuon", model, lr=2e-3)

The core (this package minus ``meqmuon.train``) depends on torch alone.

The public names (:data:`meqmuon.optim.__all__` and ``functional``) are loaded on first use (PEP 562's
module ``__getattr__``), not by ``import meqmuon``: importing torch takes ~2 s, and the ``meqmuon``
command, which imports this package first, answers ``--help`` and argument errors without it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from . import functional as functional
    from .optim import *  # noqa: F403

__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    """``meqmuon.__all__``, every name of ``meqmuon.optim.__all__`` and the submodules (``meqmuon.functional``,
    ``meqmuon.optim``, ...), imported on first access and kept as module attributes."""
    if name.startswith("__") and name != "__all__":  # what tools probe (__path__, __wrapped__, ...)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name != "__all__" and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value: Any = importlib.import_module(f".{name}", __name__)  # as ``import meqmuon`` made them before
    else:
        optim = importlib.import_module(".optim", __name__)
        if name == "__all__":
            value = ["functional", *optim.__all__]
        elif name in optim.__all__:
            value = getattr(optim, name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
