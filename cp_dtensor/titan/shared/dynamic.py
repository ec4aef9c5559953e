"""``[cp_dtensor] dynamic = true``'s part common to torchtitan 0.2.2 and 0.3: plan a step's global batch over
the flattened dp x cp ("loss") mesh, move this rank's tokens, and log the plan's balance (Note [Dynamic CP
in torchtitan] in v02/dynamic.py; Note [One plan over the grid] in core/dynamic.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.tools.logging import logger

from ...core.dynamic import plan_report, shard_on_grid
from ...core.plan.documents import DocumentLayout

__all__ = ["LINEAR_PAIRS", "log_balance", "shard_on_loss_mesh"]

LINEAR_PAIRS = 64  #: the linear layers' work a token, in kept-pair equivalents (the benchmark's figure)


def log_balance(plan: DocumentLayout, grid: DeviceMesh, cp: int) -> None:
    """The step's balance line (rank 0 of the job only)."""
    if dist.get_rank() != 0:
        return
    r = plan_report(plan, linear=LINEAR_PAIRS, dp=grid.size() // cp)
    logger.info(f"cp_dtensor dynamic: work max/mean {r['work']:.3f} over {grid.size()} ranks (the dp ranks' "
                f"rows alone {r.get('dp_rows', 1.0):.3f}), K/V rows received {r['rows']} (busiest rank, a "
                f"layer), tokens a rank {r['tokens']}")


def shard_on_loss_mesh(tensors: tuple[torch.Tensor, ...], grid: DeviceMesh, cp: int, ids: torch.Tensor,
                       windows: list) -> tuple[tuple[torch.Tensor, ...], DocumentLayout, torch.Tensor]:
    """This dp rank's rows ``tensors`` (each [B, N], ``ids`` their documents [B, N]) -> this rank's planned
    tokens (each [1, B * N / cp]), the global batch's plan over ``grid``, and this rank's document ids
    [1, B * N / cp] (what its mask rule reads); logs the balance line."""
    moved, plan, _ = shard_on_grid(tensors, grid, cp, document_ids=ids, windows=windows)
    log_balance(plan, grid, cp)
    return moved, plan, plan.local_ids(grid.get_local_rank()).to(ids.device)
