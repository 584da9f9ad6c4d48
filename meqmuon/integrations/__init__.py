"""Integrations with the frameworks people train with.

Each imports its framework only when it is imported itself (``import meqmuon`` never does), and says which
release of the framework it follows:

- :mod:`meqmuon.integrations.torchtitan`: an ``OptimizersContainer`` of torchtitan's whose optimizers meqmuon
  builds, and torchtitan's configs with it for ``--module`` (docs/torchtitan.md).

PyTorch Lightning needs no module: ``configure_optimizers`` returns ``meqmuon.build_optimizer(...)``
(docs/lightning.md).
"""
