"""``cp-dtensor plan --doc-lengths`` (tools/plan_documents.py) against brute force at tiny sizes: each rank's
positions from the layouts' definitions, the K/V rows its queries need counted pair by pair, the kept causal
pairs per rank, and the ring's (P - 1) * S rows per rank."""

from __future__ import annotations

import json
import random

import pytest

from cp_dtensor.tools import plan as P
from cp_dtensor.tools.cli import main


def _positions(name: str, world: int, n: int) -> list[list[int]]:
    """Each rank's global positions from the layouts' definitions (docs/layouts.md)."""
    s = n // world
    if name == "striped":
        return [list(range(r, n, world)) for r in range(world)]
    if name == "contiguous":
        return [list(range(r * s, (r + 1) * s)) for r in range(world)]
    c = n // (2 * world)  # headtail: chunks r and 2P - 1 - r of 2P
    return [list(range(r * c, (r + 1) * c)) + list(range((2 * world - 1 - r) * c, (2 * world - r) * c))
            for r in range(world)]


def _doc_of(lengths: list[int]) -> list[int]:
    return [d for d, length in enumerate(lengths) for _ in range(length)]


def _brute(pos: list[list[int]], lengths: list[int], window: int | None, lefts) -> tuple[list[int], list[int]]:
    """(rows needed from other ranks, kept causal pairs summed over the layers ``lefts``) per rank, pair by pair."""
    doc, n = _doc_of(lengths), sum(lengths)
    need, work = [], []
    for mine in pos:
        held = set(mine)
        keys = {j for i in mine for j in range(n)
                if doc[j] == doc[i] and 0 <= i - j and (window is None or i - j <= window) and j not in held}
        need.append(len(keys))
        work.append(sum(1 for i in mine for j in range(n) for left in lefts
                        if doc[j] == doc[i] and 0 <= i - j and (left is None or i - j <= left)))
    return need, work


def _random_rows(seed: int, n: int, batch: int) -> list[list[int]]:
    rng, rows = random.Random(seed), []
    for _ in range(batch):
        row, left = [], n
        while left:
            row.append(min(left, rng.choice([1, 2, 3, 5, 8, 13, 40])))
            left -= row[-1]
        rows.append(row)
    return rows


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("window,windows", [(None, None), (5, None), (None, [None, 3])])
def test_placements_against_brute_force(world, window, windows):
    n, d, hkv = 24 * world, 8, 2
    for seed, batch in ((0, 1), (1, 2)):
        inp = P.PlanInput(seq_len=n, cp=world, head_dim=d, q_heads=4, kv_heads=hkv, dtype="fp32", batch=batch,
                          window=window)
        rows = _random_rows(seed, n, batch)
        lefts = windows or [window]
        got = {x.placement: x for x in P.compare_placements(inp, rows, windows=windows)}
        assert list(got) == ["striped", "headtail", "contiguous", "documents"]
        s = n // world
        # the ring's steps: every block unless the window reaches fewer (contiguous: one neighbour under a short one)
        for name, x in got.items():
            need, work = [0] * world, [0] * world
            for lengths in rows:
                pos = _positions(name, world, n) if name != "documents" else P.placement_positions(
                    "documents", lengths, world, windows=lefts)
                if name == "documents":  # a partition of the row, S tokens each (the shapes stay equal)
                    assert sorted(p for r in pos for p in r) == list(range(n)) and {len(r) for r in pos} == {s}
                nd, wk = _brute(pos, lengths, window, lefts)
                need = [a + b for a, b in zip(need, nd)]
                work = [a + b for a, b in zip(work, wk)]
            assert (x.needed_rows_max, x.needed_rows_mean) == (max(need), sum(need) / world), name
            assert x.rank_pairs == tuple(work) and x.balance == pytest.approx(max(work) * world / sum(work)), name
            if name == "documents":
                assert (x.exchange, x.wire_rows_max, x.steps) == ("all-to-all-v", max(need), 1 if max(need) else 0)
                assert x.fwd_bytes_max == max(need) * hkv * 2 * d * 4
            else:
                steps = world if window is None else 1 + max(
                    t for t in range(world) if any(
                        0 <= i - j <= window for r in range(world) for i in _positions(name, world, n)[r]
                        for j in _positions(name, world, n)[(r - t) % world]))
                assert (x.exchange, x.steps, x.wire_rows_max) == ("ring", steps, (steps - 1) * batch * s), name
                assert x.fwd_bytes_max == (steps - 1) * batch * s * hkv * 2 * d * 4
        assert got["striped"].ring_rows == (got["striped"].steps - 1) * batch * s


def test_one_document_sends_no_more_than_striped():
    inp = P.PlanInput(seq_len=4096, cp=4, head_dim=8, q_heads=2, kv_heads=2)
    got = {x.placement: x for x in P.compare_placements(inp, [[4096]])}
    assert got["documents"].wire_rows_max <= got["striped"].wire_rows_max == 3 * 1024


def test_doc_lengths_file_and_distributions(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("3\n5 2\n\n6\t4 1\n")
    lengths = P.parse_doc_lengths(str(f))
    assert lengths == [3, 5, 2, 6, 4, 1]
    # packed in order, a document crossing a row's end continues on the next row
    assert P.doc_rows(lengths, 8, 2) == [[3, 5], [2, 6]]
    assert P.doc_rows(lengths, 6, 3) == [[3, 3], [2, 2, 2], [4, 2]]
    assert P.doc_rows(lengths, 7, 3) == [[3, 4], [1, 2, 4], [2, 4, 1]]
    assert P.doc_rows(("fixed", {"length": 3.0}), 8, 2) == [[3, 3, 2], [3, 3, 2]]
    dist = P.parse_doc_lengths("lognormal:median=50,sigma=0.5,seed=3")
    rows = P.doc_rows(dist, 1000, 2)
    assert [sum(r) for r in rows] == [1000, 1000] and rows[0] != rows[1]
    assert rows == P.doc_rows(P.parse_doc_lengths("lognormal:median=50,sigma=0.5,seed=3"), 1000, 2)
    assert max(max(r) for r in P.doc_rows(P.parse_doc_lengths("lognormal:median=500,cap=64"), 4096, 1)) <= 64
    for bad, what in (("lognormal:mean=5", "median"), ("lognormal:median=x", "number"), ("nofile.txt", "neither"),
                      ("lognormal:sigma=1", "median >= 1")):
        with pytest.raises(ValueError, match=what):
            P.parse_doc_lengths(bad)
    f.write_text("3 0 2")
    with pytest.raises(ValueError, match="positive"):
        P.parse_doc_lengths(str(f))
    with pytest.raises(ValueError, match="fewer than"):
        P.doc_rows([3, 4], 8, 1)


def test_cli_doc_lengths(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    lengths = [5, 1, 9, 3, 14, 2, 7, 7, 16]
    f.write_text("\n".join(map(str, lengths)))
    base = ["plan", "--seq-len", "64", "--cp", "4", "--head-dim", "8", "--heads", "2", "--dtype", "fp32",
            "--doc-lengths", str(f)]
    assert main([*base, "--json"]) == 0
    got = {x["placement"]: x for x in json.loads(capsys.readouterr().out)["documents"]}
    need, _ = _brute(_positions("striped", 4, 64), lengths, None, [None])
    assert got["striped"]["needed_rows_max"] == max(need) and got["striped"]["wire_rows_max"] == 3 * 16
    need, work = _brute(P.placement_positions("documents", lengths, 4), lengths, None, [None])
    assert got["documents"]["wire_rows_max"] == max(need)
    assert got["documents"]["vs_ring"] == pytest.approx(sum(need) / 4 / 48)
    assert got["documents"]["balance"] == pytest.approx(max(work) * 4 / sum(work))
    main([*base, "--windows", "none", "4"])
    text = capsys.readouterr().out
    assert "packed documents" in text and all(f"  {n} " in text for n in ("striped", "headtail", "contiguous", "documents"))
    # a float8 payload: one byte a value plus one exponent byte a row of K and of V, on either exchange
    main([*base, "--comm-dtype", "fp8", "--json"])
    fp8 = {x["placement"]: x for x in json.loads(capsys.readouterr().out)["documents"]}
    hkv, d = 2, 8  # --heads 2, no --kv-heads
    assert got["documents"]["fwd_bytes_max"] == max(need) * hkv * 2 * d * 4
    assert fp8["documents"]["fwd_bytes_max"] == max(need) * hkv * (2 * d + 2)
    assert fp8["striped"]["fwd_bytes_max"] == 3 * 16 * hkv * (2 * d + 2)
    with pytest.raises(SystemExit):
        main([*base, "--mean-doc-len", "8"])
    assert "not both" in capsys.readouterr().err
