"""Parameter shapes of the paper's models, by kind, without allocating a model.

The model is built on the ``meta`` device from the package's registry (``meqmuon.train.models``,
which cites each config's source) and routed with the package's own role classifier
(``meqmuon.optim.groups.classify_parameters``), so the benchmarks see exactly the tensors and kinds
``meqmuon train`` would optimise: untied Llama embeddings and heads, one tied tensor for SmolLM2 and
Qwen2, GQA key/value projections, Qwen2's q/k/v biases as vectors.
"""

from __future__ import annotations

from meqmuon.optim.groups import KINDS, classify_parameters
from meqmuon.train.models import MODELS as REGISTRY
from meqmuon.train.models import build_model

#: Model names the benchmarks accept: the registry's, i.e. the paper's six architectures and the
#: ~1M-parameter CPU presets (which the tests use to run every benchmark script in seconds).
MODELS: tuple[str, ...] = tuple(REGISTRY)


def model_shapes(name: str) -> dict[str, list[tuple[int, ...]]]:
    """``kind -> [shape]`` for registry model ``name``, in ``named_parameters`` order (tied tensors once)."""
    model = build_model(name, device="meta")
    routed = classify_parameters(model)
    shapes: dict[str, list[tuple[int, ...]]] = {k: [] for k in KINDS}
    for param_name, kind in routed["kinds"].items():
        shapes[kind].append(tuple(routed["params"][param_name].shape))
    return shapes
