"""Where the CPU time of ``meqmuon train --model llama-tiny --steps 20`` goes, phase by phase.

Run as its own process (the imports are a phase): it imports ``meqmuon.cli`` and the loop, then the
models module (transformers), then runs ``meqmuon.cli.main(["train", ...])`` in this process with the
loop's ``build_run``, ``_train_step``, ``_evaluate`` and ``_save`` wrapped to add up
``time.process_time()`` (CPU seconds of this process, which the machine's load changes little, unlike
wall time). Every flag not given keeps its default; flags after ``--`` go to ``meqmuon train``.

    PYTHONPATH=. python benchmarks/train_phases.py            # docs/benchmarks.md, "Wall time of a 20-update ..."
    PYTHONPATH=. python benchmarks/train_phases.py --steps 2 -- --seq-len 16
"""

from __future__ import annotations

import time

_T0, _W0 = time.process_time(), time.perf_counter()

import argparse  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import meqmuon.cli as cli  # noqa: E402
import meqmuon.train.loop as loop  # noqa: E402

_IMPORT_CLI = time.process_time() - _T0

import meqmuon.train.models  # noqa: E402,F401  (transformers)

_IMPORT_MODELS = time.process_time() - _T0 - _IMPORT_CLI

PHASES = {"build_run": "data, model, optimizer", "_train_step": "updates", "_evaluate": "evaluation",
          "_save": "checkpoints"}


def _wrap(spent: dict[str, float]) -> None:
    for name, label in PHASES.items():
        inner = getattr(loop, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t = time.process_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.process_time() - t

        setattr(loop, name, timed)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    spent: dict[str, float] = {}
    _wrap(spent)
    with tempfile.TemporaryDirectory() as tmp:
        rc = cli.main(["train", "--model", args.model, "--steps", str(args.steps), "--out", str(Path(tmp) / "r"),
                       "--quiet", *extra])
    total = time.process_time() - _T0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    from meqmuon.precision import detect_cpu_capability

    print(f"\nCPU seconds, `meqmuon train --model {args.model} --steps {args.steps}` {' '.join(extra)}"
          f"(CPU {detect_cpu_capability()}; wall {time.perf_counter() - _W0:.1f} s)\n")
    print("| phase | CPU s |\n|---|---:|")
    print(f"| import meqmuon.cli + loop | {_IMPORT_CLI:.2f} |")
    print(f"| import meqmuon.train.models (transformers) | {_IMPORT_MODELS:.2f} |")
    for label in PHASES.values():
        print(f"| {label} | {spent.get(label, 0.0):.2f} |")
    print(f"| total since the script's first line (user {ru.ru_utime:.2f} + sys {ru.ru_stime:.2f}) | {total:.2f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
