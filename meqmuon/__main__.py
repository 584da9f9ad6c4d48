"""``python -m meqmuon ...`` (also what ``torchrun -m meqmuon ...`` runs): the ``meqmuon`` command."""

from meqmuon.cli import _entry

if __name__ == "__main__":
    _entry()
