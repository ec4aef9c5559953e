"""The whole-model memory model (tools/plan_model.py, ``cp-dtensor longest``): its terms against hand-computed
bytes, the longest S_local against the budget it was searched for, and the CLI's refusals."""

from __future__ import annotations

import json

import pytest

from cp_dtensor.tools import cli
from cp_dtensor.tools.plan import GIB
from cp_dtensor.tools.plan_model import MODELS, ModelShape, longest_s_local, model_memory

TINY = MODELS["bench-tiny"]


def test_head_and_mlp_terms_by_hand():
    """fp32, S = 3072: the untiled head holds S V (2 * 4 + 8) bytes plus the hidden gradient; tiled, one tile's
    worth; the untiled SwiGLU saves 4 I e a token a layer, the tiled one nothing (a tile of 6 I e while it runs)."""
    s, v, h, i = 3072, TINY.vocab, TINY.hidden, TINY.intermediate
    untiled = model_memory(TINY, s, cp=2, dtype="fp32")
    tiled = model_memory(TINY, s, cp=2, dtype="fp32", tile=1024)
    assert untiled["head_loss"] == s * v * 16 + 2 * h * 4 * s
    assert tiled["head_loss"] == 1024 * v * 16 + 2 * h * 4 * s
    assert untiled["layers"] == 2 * (4 * h * 4 * s + 4 * i * 4 * s)
    assert tiled["layers"] == 2 * 4 * h * 4 * s and tiled["mlp_tile"] == 6 * i * 4 * 1024
    assert untiled["attention"] == tiled["attention"]
    ckpt = model_memory(TINY, s, cp=2, dtype="fp32", checkpointing="full")
    assert ckpt["layers"] == 2 * h * 4 * s + (4 * h * 4 * s + 4 * i * 4 * s)  # inputs + one layer recomputed


def test_longest_fits_and_the_next_does_not():
    shape = MODELS["llama3-8b"]
    for tile in (None, 1024):
        s = longest_s_local(shape, 80, cp=8, tile=tile, checkpointing="full", reserved_gib=18)
        kw = dict(cp=8, tile=tile, checkpointing="full", reserved_gib=18)
        assert s % 256 == 0 and model_memory(shape, s, **kw)["total"] <= 80 * GIB
        assert model_memory(shape, s + 256, **kw)["total"] > 80 * GIB
    assert longest_s_local(ModelShape(64, 128, 1, 100, 2, 2, 32), 0.0001, cp=1) == 0


def test_cli_longest_8b_at_cp8(capsys):
    assert cli.main(["longest", "--model", "llama3-8b", "--cp", "8", "--mem-budget-gib", "80", "--reserved-gib", "18",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiled"]["seq_len"] == 8 * out["tiled"]["s_local"]
    assert out["ratio"] >= 4 and out["tiled"]["memory"]["total"] <= 80 * GIB
    with pytest.raises(SystemExit):
        cli.main(["longest", "--model", "llama3-8b", "--cp", "0", "--mem-budget-gib", "80"])
    with pytest.raises(ValueError, match="checkpointing"):
        model_memory(TINY, 10, cp=1, checkpointing="some")
