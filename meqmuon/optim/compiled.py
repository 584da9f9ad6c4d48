"""The generic part of ``compile=True``: compiling a bucket's step, once, without recompiles.

The hidden rules' compiled form is the driver's own bucket body (``hidden.py``), the elementwise
rules' their ``compiled_bucket`` (``rules/``); this module only compiles and caches. Hyperparameters
(lr, weight decay, momentum, rho) enter the graphs as 0-D float64 CPU tensors (:func:`scalar`), not
Python floats, so a schedule that changes them every step does not recompile (Python floats would be
guarded as constants; tested with ``torch._dynamo`` counters). The graphs are ``fullgraph=True``;
choices stay tensors, and a step makes no host-device synchronisation. Newton-Schulz inside a graph
is matmuls; the maths is the eager forms', only the rounding of the fused expressions differs.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["BACKEND", "bucket_step", "scalar"]

def scalar(x: float) -> Tensor:
    """A 0-D float64 CPU tensor: a graph input whose value may change without recompiling."""
    return torch.tensor(x, dtype=torch.float64)


#: The torch.compile backend of the bucket graphs (tests may use a cheaper one to count recompiles).
BACKEND = "inductor"
_bucket_graphs: dict[tuple, object] = {}


def bucket_step(label: str, fn: Callable[..., Any], key: tuple, *args: object, **static: object) -> Any:
    """Run ``fn`` (a rule's ``compiled_bucket``, named ``label``) compiled for the bucket ``key``.

    ``args`` are the bucket's tensor lists and the 0-D hyperparameter tensors; ``static`` the rule's
    Python constants. One graph per bucket, compiled once, with no recompile limit on the number of
    buckets: dynamo caches graphs per code object (at most ``recompile_limit`` = 8 per code object,
    and ``fullgraph=True`` raises on the ninth), so each bucket compiles its own copy of ``fn``,
    with its own code object, and ``static`` baked in as its keyword defaults.

    The copy itself is what ``torch.compile`` gets: given a ``functools.partial`` (no source file,
    not a function), it compiles dynamo's ``external_utils.wrap_inline`` around it, whose ``inner``
    is one code object for every such callable; every bucket then landed in that code object's
    cache, its entries told apart by a guard on ``fn.func.__code__``, and the ninth bucket hit the
    limit whatever the copies' code objects. A graph is keyed on the
    member count and the first dtype of each tensor list as well (two param groups with the same
    shapes but another size or ``state_dtype`` get copies of their own, not a recompile of one
    copy), and on ``BACKEND``.
    """
    signature = tuple((len(a), a[0].dtype if a else None) if isinstance(a, list) else None for a in args)
    full = (label, key, signature, tuple(sorted((k, repr(v)) for k, v in static.items())), BACKEND)
    graph = _bucket_graphs.get(full)
    if graph is None:
        # A readable name that is a function of the bucket: dynamo's automatic-dynamic state (pgo.py)
        # is keyed on (file, line, name), so two copies sharing a name could share it.
        code = fn.__code__.replace(co_name=f"{fn.__name__}{full[1:]}")
        clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        clone.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **static}
        graph = _bucket_graphs[full] = torch.compile(clone, fullgraph=True, backend=BACKEND)
    return graph(*args)
