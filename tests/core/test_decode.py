"""cp_dtensor.sharded_cache_attention (decode.py): replicated queries against a KV cache scattered over the
ranks by position equal float64 attention over the union of the keys; bytes on the wire by the formula;
every error raised on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_dtensor import sharded_cache_attention
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import rel_err

TOL = 2e-5  # fp32 vs float64, relative to the largest magnitude


def _reference(q, k, v, qp, kp, scale, window, sinks):
    """float64 attention by the textbook formula over all keys: q [B, Hq, T, D], k/v [B, Hkv, S, D], positions
    [B, T] / [B, S] (-1 never attended); None where a query sees no key and has no sinks."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    i, j = qp[:, None, :, None], kp[:, None, None, :]
    keep = (j >= 0) & (j <= i)
    if window is not None:
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    if not bool(keep.any(-1).all()):
        return None
    return torch.softmax(s, -1) @ v


def _case(seed: int, world: int, *, b=2, hq=4, hkv=2, t=1, d=16, dv=None, n=40, holes=0.2, window=None, sinks=False,
          empty=None, dtype=torch.float32):
    """Global tensors (the same on every rank) and each rank's share: the cache's N prompt slots plus the T
    new tokens' own slots, at shuffled positions (each row its own order), a fraction of empty slots (-1),
    scattered over the ranks unevenly; rank ``empty`` holds none."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    s = n + t
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64)
    qp = torch.stack([torch.randperm(t, generator=g) + n for _ in range(b)])  # the new tokens at n .. n+T-1
    kp = torch.cat([torch.stack([torch.randperm(n, generator=g) for _ in range(b)]), qp], 1)  # [B, S]
    hole = torch.rand(b, s, generator=g) < holes
    hole[:, n:] = False  # each new token sees at least its own key
    kp = kp.masked_fill(hole, -1)
    sk = torch.randn(hq, generator=g, dtype=torch.float64) * 2 if sinks else None
    owner = torch.randint(0, world, (s,), generator=g)
    if empty is not None and world > 1:
        owner[owner == empty] = (empty + 1) % world
    owner = owner[torch.randperm(s, generator=g)]
    return dict(q=q, k=k, v=v, qp=qp, kp=kp, sinks=sk, owner=owner, window=window, dtype=dtype)


def _run(c, rank, scale=None):
    mine = torch.nonzero(c["owner"] == rank).flatten()
    cast = lambda x: x.to(c["dtype"])  # noqa: E731
    return sharded_cache_attention(
        cast(c["q"]), cast(c["k"][:, :, mine]), cast(c["v"][:, :, mine]), q_positions=c["qp"],
        k_positions=c["kp"][:, mine].contiguous(), scale=scale, window_size=c["window"],
        sinks=None if c["sinks"] is None else c["sinks"].float(),
    )


CASES = [
    dict(),  # GQA, T = 1 (a decode step)
    dict(t=5, holes=0.4),  # T > 1 (a chunk / speculative verification)
    dict(hq=4, hkv=1, t=3),  # MQA
    dict(hq=3, hkv=3, d=8, dv=24, t=2),  # MHA, Dv > Dqk
    dict(d=32, dv=8, t=4),  # Dv < Dqk
    dict(window=(6, 0), t=3),  # a sliding window
    dict(window=(0, -1), t=2),  # only its own key
    dict(window=(9, 3), t=6, holes=0.0),  # a two-sided window (right has no effect: causal)
    dict(sinks=True, t=3, window=(4, 0)),  # gpt-oss: sinks and a window
    dict(empty=0, t=2),  # rank 0 holds no key
    dict(empty=1, n=3, t=1, sinks=True),  # a short cache, one rank empty
    dict(b=1, n=200, t=2, holes=0.5),  # longer cache
]


def _check_values(rank: int, world: int) -> int:
    checked = 0
    for i, opts in enumerate(CASES):
        c = _case(100 + i, world, **opts)
        scale = 0.3 if i % 3 == 2 else None
        with torch.no_grad():
            out = _run(c, rank, scale)
        ref = _reference(c["q"], c["k"], c["v"], c["qp"], c["kp"], scale, c["window"], c["sinks"])
        assert out.dtype == torch.float32 and out.shape == ref.shape, (opts, out.shape)
        assert not out.requires_grad
        err = rel_err(out, ref)
        assert err <= TOL, f"case {opts}: {err:.2e}"
        if world > 1:  # bit-identical on every rank
            every = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(every, out)
            assert all(torch.equal(e, out) for e in every), opts
        checked += 1
    # the cache in chunks of keys (merged like ranks): a chunk of 5 * 8 score elements here
    import cp_dtensor.core.decode as decode

    saved, decode._CHUNK = decode._CHUNK, 40
    try:
        for opts in (dict(t=1, n=60, holes=0.3), dict(t=3, window=(7, 0), sinks=True, n=50)):
            c = _case(12, world, b=1, **opts)
            ref = _reference(c["q"], c["k"], c["v"], c["qp"], c["kp"], None, c["window"], c["sinks"])
            assert rel_err(_run(c, rank), ref) <= TOL, opts
    finally:
        decode._CHUNK = saved
    # bf16 inputs: merged in fp32, returned in bf16
    c = _case(7, world, t=2, dtype=torch.bfloat16)
    out = _run(c, rank)
    ref = _reference(*(c[x].bfloat16() for x in ("q", "k", "v")), c["qp"], c["kp"], None, None, None)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 1e-2
    # a query whose only visible key is an empty slot elsewhere and sinks: zero output
    c = _case(8, world, t=1, sinks=True, window=(0, 0))
    c["kp"][:, -1] = -1
    out = _run(c, rank)
    assert torch.equal(out, torch.zeros_like(out))
    # the bytes each rank sends: (P - 1) * B * Hq * T * (Dv + 1) * 4 for [out | lse], plus the 8-byte
    # agreement digest to each peer -- within the bound P * B * Hq * T * (Dv + 1) * 4
    for opts in (dict(), dict(t=3, dv=24, hq=4, hkv=1), dict(n=400)):
        c = _case(9, world, **opts)
        with CommBytes() as cb:
            _run(c, rank)
        b, hq, t, dv = c["q"].shape[0], c["q"].shape[1], c["q"].shape[2], c["v"].shape[3]
        data = b * hq * t * (dv + 1) * 4
        assert cb.sent == (world - 1) * (data + 8), (opts, cb.by_op, data)
        assert cb.sent <= world * data
    return checked


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_errors(rank: int, world: int) -> None:
    c = _case(11, world, t=2)
    mine = torch.nonzero(c["owner"] == rank).flatten()
    q, k, v = c["q"].float(), c["k"][:, :, mine].float(), c["v"][:, :, mine].float()
    qp, kp = c["qp"], c["kp"][:, mine].contiguous()
    call = lambda **kw: sharded_cache_attention(**{"q": q, "k": k, "v": v, "q_positions": qp,  # noqa: E731
                                                   "k_positions": kp, **kw})
    last = world - 1
    # a query that sees no key anywhere: decided from the merged lse, on every rank
    _expect("sees no key on any rank", lambda: call(q_positions=qp - 100))
    _expect("sees no key on any rank", lambda: call(window_size=(0, 0), k_positions=kp.masked_fill(kp >= 40, -1)))
    # local errors, on one rank only
    _expect("k_positions must be an int64", lambda: call(k_positions=kp.int() if rank == last else kp))
    _expect("multiple of k/v heads", lambda: call(q=q[:, :3] if rank == 0 else q))
    _expect("window_size", lambda: call(window_size=(-3, 0) if rank == last else None))
    _expect("forward only", lambda: call(q=q.clone().requires_grad_(rank == 0)))
    _expect("sinks must be", lambda: call(sinks=torch.zeros(3) if rank == 0 else None))
    if world > 1:
        # disagreements: each rank is fine alone
        _expect("same new_tokens", lambda: call(q=q[:, :, :1] if rank == last else q,
                                                q_positions=qp[:, :1] if rank == last else qp))
        _expect("same scale", lambda: call(scale=0.5 if rank == 0 else None))
        _expect("same window_left", lambda: call(window_size=(4, 0) if rank == 0 else (5, 0)))
        _expect("same sinks", lambda: call(sinks=torch.zeros(4) + (rank == last)))
        _expect("same q_values", lambda: call(q=q + (rank == 0)))
        _expect("same q_positions", lambda: call(q_positions=qp + (rank == last)))
        _expect("same value_head_dim", lambda: call(v=v[..., :8] if rank == 0 else v))
    # still in step: a good call equals the reference
    out = call()
    ref = _reference(c["q"], c["k"], c["v"], c["qp"], c["kp"], None, None, None)
    assert rel_err(out, ref) <= TOL


def _all(rank: int, world: int) -> int:
    n = _check_values(rank, world)
    _check_errors(rank, world)
    return n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_cache_attention_matches_float64(world):
    """Random positions (unsorted, empty slots), uneven and empty shards, GQA/MQA, Dv != Dqk, windows, sinks,
    T = 1 and T > 1; bit-identical on every rank; bytes by the formula; errors on every rank."""
    assert run_ranks(world, _all) == [len(CASES)] * world


def test_without_process_group():
    """No process group: the op is plain local attention."""
    c = _case(3, 1, t=2, window=(5, 0), sinks=True)
    out = _run(c, 0)
    ref = _reference(c["q"], c["k"], c["v"], c["qp"], c["kp"], None, c["window"], c["sinks"])
    assert rel_err(out, ref) <= TOL
