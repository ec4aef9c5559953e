"""The CUDA kernels' real host-side rules, emulated on CPU (tests/_cuda.py): flash's window conversion
(max_seqlen_k) and bottom-right alignment, empty rows (out 0, lse +inf), the memory-efficient kernel with a
mask only in fp32, and the ring's kernel choice under torch's SDPA backend switches. See Note [Kernel
contracts] in cp_dtensor/core/kernels.py (issue 53).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _cuda import StrictCuda, as_cuda, flash_window, keep_mask
from _tiers import slow

import cp_dtensor
from cp_dtensor.tools.plan_documents import lognormal_lengths
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_flash_window_rules_read_from_torch():
    """The stand-in's host rules on the shapes issue 53 measured: an open right side in a rectangle taller
    than max_seqlen_k + 1 loses its first rows' latest keys; max_seqlen_k >= the rectangle's height keeps
    the window as meant; a side >= max_seqlen_k is dropped."""
    # 10 rows x 3 keys, window (left 2, right open): meant: row r keeps keys >= r - 7 - 2, i.e. all for r <= 9
    assert flash_window(2, -1, False, 10, 3, forward=True) == (2, 3)
    lost = ~keep_mask(10, 3, (2, 3)) & keep_mask(10, 3, (2, -1))
    assert lost.any(1).tolist()[:3] == [True, True, True]  # rows 0..2 lose keys (row 0 keeps none)
    assert not keep_mask(10, 3, (2, 3))[0].any()
    assert flash_window(2, -1, False, 10, 10, forward=True) == (2, 10)
    assert torch.equal(keep_mask(10, 3, (2, 10)), keep_mask(10, 3, (2, -1)))
    assert flash_window(5, 0, False, 4, 4, forward=True) == (4, 0)  # left >= max_k: dropped, then max_k
    assert flash_window(-1, -1, True, 1, 9, forward=True) == (-1, -1)  # one query row: not causal (forward)
    assert flash_window(-1, -1, True, 1, 9, forward=False) == (9, 0)


def _packed_docs(seed: int, n: int, median: float) -> torch.Tensor:
    return _ids(lognormal_lengths(seed, n, median))


def _rules_cases(rank, world, seeds):
    """Every layout (and the documents placement) x {documents + window + sinks, documents + window}, bf16,
    several log-normal packings each, forward + backward through the flash stand-ins with torch's host
    rules, against float64. Returns per case (error, non-finite count) and the stand-in's counters."""
    s, hq, hkv, d, window = 32, 4, 2, 16, (12, 0)
    n = s * world
    results, counters = {}, {"tall": 0, "changed": 0, "empty_rows": 0, "windowed": 0}
    layouts = [*cp_dtensor.LAYOUTS, "documents"]
    for li, layout in enumerate(layouts):
        for with_sinks in (True, False):
            for seed in range(seeds):
                ids = _packed_docs(100 * li + 10 * seed + with_sinks, n, median=12.0)[None]  # [1, N]
                g = torch.Generator().manual_seed(seed)
                q = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
                k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
                v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
                do = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
                sinks = torch.randn(hq, generator=g, dtype=torch.float64) if with_sinks else None
                want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=window, sinks=sinks)
                lay = cp_dtensor.document_layout(ids, world, windows=[window]) if layout == "documents" else layout

                def shard(x, dim=2, lay=lay):
                    return cp_dtensor.shard_tensor(x, seq_dim=dim, layout=lay, rank=rank, cp_size=world)

                ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
                sl = None if sinks is None else sinks.float().requires_grad_()
                standin = StrictCuda()
                with as_cuda(standin):
                    out = cp_dtensor.ring_attention(ql, kl, vl, layout=lay, is_causal=True, window_size=window,
                                                    document_ids=shard(ids, 1), sinks=sl)
                    out.backward(shard(do).to(torch.bfloat16))
                got = [out, ql.grad, kl.grad, vl.grad]
                refs = [shard(w) for w in want[:4]]
                if sl is not None:
                    total = sl.grad.clone()
                    dist.all_reduce(total)
                    got.append(total)
                    refs.append(want[4])
                bad = sum(int((~torch.isfinite(x.float())).sum()) for x in got)
                err = max(abs_rel_err(torch.nan_to_num(a.float(), 1e6, 1e6, -1e6), b) for a, b in zip(got, refs))
                key = f"{layout}{'+sinks' if with_sinks else ''}"
                prev = results.get(key, (0.0, 0))
                results[key] = (max(prev[0], err), prev[1] + bad)
                for name in counters:
                    counters[name] += getattr(standin, name)
                assert standin.calls, "the CUDA branch ran no kernel"
    return results, counters


@pytest.mark.parametrize("world, seeds", [(2, 1), pytest.param(4, 3, marks=slow("P = 4, three packings"))])
def test_documents_and_windows_under_flash_host_rules_match_float64(world, seeds):
    """Issue 53 item 1: packed log-normal documents + a sliding window (+ sinks, gpt-oss), bf16, every
    layout and the documents placement: within bf16 tolerance of float64 on every rank, nothing
    non-finite (outputs and gradients, the sinks' included), with rectangles taller than their call's
    keys exercised."""
    per_rank = run_ranks(world, _rules_cases, seeds)
    tall = sum(c["tall"] for _, c in per_rank)
    assert tall > 0, per_rank  # the shape max_seqlen_k decides was exercised
    for rank, (results, _) in enumerate(per_rank):
        for key, (err, bad) in results.items():
            assert bad == 0 and err <= 3e-2, (world, rank, key, err, bad)
