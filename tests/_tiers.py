"""The test tiers (docs/testing.md, "Tiers").

* default -- ``bash scripts/test.sh``: every feature at small shapes, under 15 minutes on 2 CPU cores;
* ``CP_DTENSOR_SLOW=1`` -- the slow tier CI runs (``.ci/run``): one end-to-end run per composition
  that the default tier does not reach (CP = 4, FSDP x CP, CP x TP, compiled float8, Ulysses x ring,
  validation, gpt_oss from its TOML, ...), sized so that CI's two legs stay under 70 minutes;
* ``CP_DTENSOR_SLOW=all`` -- everything: the slow tier plus every other family x degree x composition
  (~40 more minutes on 2 cores). Not in CI; run it by hand before a release or after touching
  the torchtitan plugin;
* ``CP_DTENSOR_GPU=1`` -- the GPU tier: tests of the CUDA branches on the real CUDA kernels (flash, the
  memory-efficient kernel, varlen flash) against float64, on a machine with a CUDA device; skipped, with
  the reason, without the variable or without a device. Independent of the slow tiers.
"""

from __future__ import annotations

import os

import pytest

LEVEL = os.environ.get("CP_DTENSOR_SLOW", "0")
if LEVEL not in ("0", "", "1", "all"):
    raise ValueError(f"CP_DTENSOR_SLOW must be 0, 1 or all; got {LEVEL!r}")
SLOW = LEVEL in ("1", "all")
ALL = LEVEL == "all"
GPU_LEVEL = os.environ.get("CP_DTENSOR_GPU", "0")
if GPU_LEVEL not in ("0", "", "1"):
    raise ValueError(f"CP_DTENSOR_GPU must be 0 or 1; got {GPU_LEVEL!r}")
GPU = GPU_LEVEL == "1"


def slow(why: str = "slow tier"):
    """Runs with CP_DTENSOR_SLOW=1 (CI) and =all."""
    return pytest.mark.skipif(not SLOW, reason=f"{why}; set CP_DTENSOR_SLOW=1")


def exhaustive(why: str = "exhaustive tier, not in CI"):
    """Runs with CP_DTENSOR_SLOW=all only (by hand)."""
    return pytest.mark.skipif(not ALL, reason=f"{why}; set CP_DTENSOR_SLOW=all")


def gpu(why: str = "GPU tier"):
    """Runs with CP_DTENSOR_GPU=1 where a CUDA device exists (checked only then: no CUDA call otherwise)."""
    if not GPU:
        return pytest.mark.skipif(True, reason=f"{why}; set CP_DTENSOR_GPU=1 on a machine with a CUDA device")
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{why}: CP_DTENSOR_GPU=1 but no CUDA device here")
