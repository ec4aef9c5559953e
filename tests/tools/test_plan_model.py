"""The whole-model memory model (tools/plan_model.py, ``cp-dtensor longest``): its terms against hand-computed
bytes, the longest S_local against the budget it was searched for, and the CLI's refusals."""

from __future__ import annotations

import json

import pytest

from cp_dtensor.tools import cli
from cp_dtensor.tools.plan import GIB
from cp_dtensor.tools.plan_model import MODELS, ModelShape, longest_s_local, model_memory, params_per_rank

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
    for bad, said in ((["--mem-budget-gib", "10", "--reserved-gib", "18"], "below --mem-budget-gib (10)"),
                      (["--mem-budget-gib", "-1"], "below --mem-budget-gib (-1)"),
                      (["--mem-budget-gib", "80", "--pp", "33"], "exceeds the model's 32 layers")):
        with pytest.raises(SystemExit):  # llama3-8b: 32 layers
            cli.main(["longest", "--model", "llama3-8b", "--cp", "8", *bad])
        assert said in capsys.readouterr().err, bad
    with pytest.raises(ValueError, match="checkpointing"):
        model_memory(TINY, 10, cp=1, checkpointing="some")


def test_pipeline_stages_by_hand():
    """fp32, untiled, no checkpointing, 2 layers: at PP = 2 a stage holds one layer; 1F1B's first stage holds 2
    microbatches in flight (no head), its last stage 1 (with the head); GPipe's hold all M."""
    s, v, h, i = 2048, TINY.vocab, TINY.hidden, TINY.intermediate
    one = model_memory(TINY, s, cp=2, dtype="fp32")  # PP = 1: 2 layers + head
    layer = 4 * h * 4 * s + 4 * i * 4 * s  # one layer's non-attention saved bytes, one microbatch
    head = s * v * 16 + 2 * h * 4 * s
    assert one["layers"] == 2 * layer and one["head_loss"] == head
    f1b = model_memory(TINY, s, cp=2, dtype="fp32", pp=2)
    # the last stage (1 microbatch, 1 layer, the head) outweighs the first (2 microbatches of 1 layer) here
    assert f1b["head_loss"] == head and f1b["layers"] == layer
    assert f1b["total"] < one["total"]
    gpipe = model_memory(TINY, s, cp=2, dtype="fp32", pp=2, schedule="GPipe", microbatches=4)
    assert gpipe["layers"] == 4 * layer and gpipe["head_loss"] == 4 * head  # every microbatch in flight
    small_vocab = ModelShape(TINY.hidden, TINY.intermediate, 2, 16, 4, 4, 32)  # a tiny head: the first stage wins
    first = model_memory(small_vocab, s, cp=2, dtype="fp32", pp=2, microbatches=8)
    assert first["head_loss"] == 0 and first["layers"] == 2 * layer
    with pytest.raises(ValueError, match="schedule is '1F1B' or 'GPipe'"):
        model_memory(TINY, s, cp=2, pp=2, schedule="Interleaved1F1B")


def test_cli_longest_with_pipeline(capsys):
    base = ["longest", "--model", "llama3-70b", "--cp", "8", "--mem-budget-gib", "80", "--reserved-gib", "20", "--json"]
    assert cli.main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--pp", "4"]) == 0
    staged = json.loads(capsys.readouterr().out)
    # a quarter of the layers a stage: with full checkpointing (the default) the first stage's 4 microbatches of
    # L / 4 layer inputs weigh the same as one of L, and the head moves to the last stage: a longer S_local fits
    assert staged["untiled"]["s_local"] >= alone["untiled"]["s_local"]
    assert staged["tiled"]["memory"]["total"] <= 80 * GIB


def test_tensor_parallel_terms_by_hand():
    """fp32, S = 2048, TP = 2: a rank runs half the heads, half the SwiGLU width and half the vocabulary; the
    residual inputs are sequence-sharded, the norms' outputs all-gathered (Note [Plan model memory])."""
    from cp_dtensor.tools.plan import PlanInput, memory_bytes

    s, v, h, i, tp = 2048, TINY.vocab, TINY.hidden, TINY.intermediate, 2
    got = model_memory(TINY, s, cp=2, dtype="fp32", tp=tp)
    assert got["layers"] == 2 * (2 * h * 4 * s + 2 * h * 4 * s // tp + 4 * (i // tp) * 4 * s)
    assert got["head_loss"] == s * (v // tp) * 16 + 2 * h * 4 * s
    attn = memory_bytes(PlanInput(seq_len=2 * s, cp=2, head_dim=TINY.head_dim, q_heads=TINY.q_heads // tp,
                                  kv_heads=TINY.kv_heads // tp, dtype="fp32", layers=1, layout="contiguous"))
    assert got["attention"] == 2 * attn["saved_per_layer"] + max(attn["forward_working_set"],
                                                                 attn["backward_working_set"])
    tiled = model_memory(TINY, s, cp=2, dtype="fp32", tp=tp, tile=512, checkpointing="full")
    assert tiled["mlp_tile"] == 6 * (i // tp) * 4 * 512 and tiled["head_loss"] == 512 * (v // tp) * 16 + 2 * h * 4 * s
    assert tiled["layers"] == 2 * h * 4 * s // tp + (2 * h * 4 * s + 2 * h * 4 * s // tp)  # inputs + one recomputed
    assert model_memory(TINY, s, cp=2, dtype="fp32", tp=1) == model_memory(TINY, s, cp=2, dtype="fp32")
    with pytest.raises(ValueError, match=r"tp \(3\) must be a positive int that divides the query heads \(4\)"):
        model_memory(TINY, s, cp=2, tp=3)


def test_params_per_rank_by_hand():
    shape = MODELS["llama3-8b"]  # 8,030,261,248 parameters (Llama 3 8B's published count)
    assert params_per_rank(shape) == shape.params == 8_030_261_248
    h, hd, layers, v = 4096, 128, 32, 128256
    layer8 = h * hd * (2 * 32 + 2 * 8) // 8 + 3 * h * 14336 // 8 + 2 * h  # q, k, v, o; SwiGLU; norms whole
    assert params_per_rank(shape, tp=8) == layers * layer8 + 2 * (v // 8) * h + h
    layer2 = h * hd * (2 * 32 + 2 * 8) // 2 + 3 * h * 14336 // 2 + 2 * h
    assert params_per_rank(shape, tp=2, pp=4) == 8 * layer2 + (v // 2) * h + h  # the last stage: head + final norm


def test_cli_tensor_parallel(capsys):
    base = ["longest", "--model", "llama3-70b", "--cp", "8", "--mem-budget-gib", "80", "--reserved-gib", "20", "--json"]
    assert cli.main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--tp", "8", "--pp", "2"]) == 0
    tp = json.loads(capsys.readouterr().out)
    assert tp["params_per_rank"] == params_per_rank(MODELS["llama3-70b"], tp=8, pp=2)
    assert tp["untiled"]["s_local"] > alone["untiled"]["s_local"] and tp["tiled"]["memory"]["total"] <= 80 * GIB
    # `plan --tp T` costs a rank's attention: the same as planning Hq / T and Hkv / T heads
    plan = ["plan", "--seq-len", "128k", "--cp", "8", "--head-dim", "128", "--json"]
    assert cli.main([*plan, "--q-heads", "64", "--kv-heads", "8", "--tp", "4"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert cli.main([*plan, "--q-heads", "16", "--kv-heads", "2"]) == 0
    assert split == json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.main([*plan, "--q-heads", "64", "--kv-heads", "8", "--tp", "3"])
