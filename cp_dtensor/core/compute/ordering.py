"""The compile-ordering ops: ``after`` and ``tie_`` order a compiled graph's collectives after a value
exists, with no kernel (Note [Compiled backward re-sends K/V] in ring.py, Note [Compiled agreement] in
checks.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["after", "tie", "tie_"]


@torch.library.custom_op("cp_dtensor::after", mutates_args=())
def after(x: Tensor, dep: Tensor) -> Tensor:
    """A copy of ``x`` that the compiler must compute after ``dep`` exists. See Note [Compiled backward
    re-sends K/V] in ring.py: it keeps the backward's K/V rotations in the backward graph."""
    return x.clone()


@after.register_fake
def _(x, dep):
    return torch.empty_like(x)


@torch.library.custom_op("cp_dtensor::tie_", mutates_args=("buf",))
def tie_(buf: Tensor, dep: Tensor) -> None:
    """Nothing, done to ``buf`` once ``dep`` exists: in a compiled graph every later reader of ``buf`` (the
    first K/V collective) then comes after ``dep`` (the agreement). See Note [Compiled agreement] in
    checks.py. Inductor re-inplaces it: no copy, no kernel."""


@tie_.register_fake
def _(buf, dep):
    return None


def tie(buf: Tensor, ready: Tensor | None) -> Tensor:
    """``buf``, tied after ``ready`` when given (compiled calls; eager passes None)."""
    if ready is not None:
        with torch.no_grad():  # the tie has no gradient: keep it out of autograd (2-D: q, k, v's heads)
            tie_(buf, ready)
    return buf
