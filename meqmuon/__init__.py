"""meqmuon: MeqMuon (Matrix-Equilibrating Muon) and faithful Muon-family baselines for LLM pretraining.

Quick start::

    import meqmuon
    groups = meqmuon.param_groups(model)      # hidden / embedding / head / vector, by role
    opt = meqmuon.MeqMuon(groups, lr=2e-3)    # or Muon / NorMuon / Scale on the same groups
    # or: opt = meqmuon.build_optimizer("meqmuon", model, lr=2e-3)

The core (this package minus ``meqmuon.train``) depends on torch alone.
"""

from . import functional
from .optim import *  # noqa: F403  (the public names, listed once: meqmuon.optim.__all__)
from .optim import __all__ as _OPTIM_NAMES

__version__ = "0.2.0"

__all__ = ["functional", *_OPTIM_NAMES]
