"""``[cp_dtensor] sequence_tiling`` under torchtitan 0.2.2 (Note [Sequence tiling in torchtitan]).

Reference: torchtitan's own llama3 model (float64, its full ``output`` head, dense attention under its own
block_causal mask) and ``F.cross_entropy`` summed over the tokens (torchtitan's reduction) at CP = 1, no
plugin code. The plugin's tiled model (tile 5:
ragged tiles of the 32 / 64 tokens a rank holds) at CP = 1 and at CP = 2 (ring, striped and documents)
must give the same loss (summed over the CP ranks) to 1e-10 relative and the same gradients of every
parameter -- the head, the embeddings, the MLPs -- to 1e-9, and the head must never produce V columns.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import types

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))

from _tiers import slow  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _dist import run_ranks  # noqa: E402
from _titan_run import CONFIG, reference_run, step_losses, torchrun  # noqa: E402

B, N, EOS, TILE = 2, 64, 1, 5


def _model():
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = copy.deepcopy(llama3_args["debugmodel_flex_attn"])
    args.n_layers, args.vocab_size = 2, 512
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.double()


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 500, (B, N), generator=g)
    tokens[0, [5, 20, 41]] = EOS  # packed documents (block_causal)
    labels = torch.randint(2, 500, (B, N), generator=g)
    labels[1, :7] = -100  # ignored tokens
    return tokens, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tiled_matches_untiled(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss

    from cp_dtensor.titan import CPDTensor, apply_ring_attention
    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling, tiled_loss
    from cp_dtensor.titan.v02.attention import shard_cp_batch

    tokens, labels = _batch()
    eos = types.SimpleNamespace(eos_id=EOS)
    ref = _model()
    # reference: torchtitan's model with dense float64 attention under its own block_causal mask_mod
    from test_titan_flex import _DenseFlex  # the flex tests' independent reference attention
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_dtensor.titan.v02.families import attention_modules

    module = importlib.import_module(type(ref).__module__)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "create_attention_mask", lambda *a, **k: create_block_mask(*a, **k, device="cpu"))
        masks = ref.get_attention_masks(tokens, eos)
    for attn in attention_modules(ref):
        attn.inner_attention = _DenseFlex(None)
    logits = ref(tokens, attention_masks=masks)  # [B, N, V] float64 (torchtitan's loss would upcast to fp32 only)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    want.backward()
    want_grads = _grads(ref)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    runs = []
    for cp_mesh, layout in ((None, "documents"), (mesh, "striped"), (mesh, "documents")):  # CP = 1: no plan needed
        model = _model()
        apply_ring_attention(model, cp_mesh, CPDTensor(layout=layout))
        apply_sequence_tiling(model, TILE)
        loss_fn = tiled_loss(cross_entropy_loss, TILE)
        kw = {"attention_masks": model.get_attention_masks(tokens, eos)}
        x, y = tokens, labels
        if cp_mesh is not None:
            x, y, kw = shard_cp_batch(tokens, labels, kw, mesh, torch.device("cpu"), layout=layout)
        pred = model(x, **kw)
        assert pred.shape == (B, x.shape[1], model.model_args.dim), "the head must pass the hidden states on"
        loss = loss_fn(pred, y)
        loss.backward()
        grads = _grads(model)
        if cp_mesh is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            for g in grads.values():
                dist.all_reduce(g)
        runs.append((layout, cp_mesh is not None, loss.detach(), grads))
    for layout, cp, loss, grads in runs:
        what = f"{layout} at CP = {world if cp else 1}"
        torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=0, msg=lambda m: f"{what}: {m}")
        assert set(grads) == set(want_grads), what
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}, {name}: {m}")
    return True


def test_tiled_head_loss_and_mlps_match_untiled():
    assert run_ranks(2, _tiled_matches_untiled) == [True, True]


def _tp_tiled_matches_untiled(rank, world, loss_par):
    """TP = 2 (torchtitan's own llama3 TP plan, loss parallel: the head vocabulary-parallel) with the tiled head
    + loss against the same model at TP = 1, untiled (float64, F.cross_entropy summed): the loss and every
    parameter's gradient (the full tensor of its DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling, tag_after_tp, tiled_loss

    def model():
        args = copy.deepcopy(llama3_args["debugmodel"])
        args.n_layers, args.vocab_size = 2, 501  # an odd vocabulary: uneven shards over TP
        torch.manual_seed(0)
        m = Transformer(args)
        with torch.no_grad():
            m.init_weights(buffer_device=torch.device("cpu"))
        return m.double()

    tokens, labels = _batch()
    ref = model()
    want = torch.nn.functional.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    want.backward()
    want_grads = _grads(ref)
    tiled = model()
    assert apply_sequence_tiling(tiled, TILE, tile_mlps=False) == (0, 2)  # under TP the MLPs stay whole
    mesh = init_device_mesh("cpu", (world,))
    apply_tp(tiled, mesh, loss_parallel=loss_par, enable_float8_tensorwise_tp=False)
    tag_after_tp(tiled)
    assert isinstance(tiled.output.weight, DTensor)
    with loss_parallel() if loss_par else contextlib.nullcontext():  # torchtitan's train context
        loss = tiled_loss(cross_entropy_loss, TILE)(tiled(tokens), labels)
        loss.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-10, atol=0)
    grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in _grads(tiled).items()}
    assert set(grads) == set(want_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    if not loss_par:  # a head TP shards otherwise than over the vocabulary: refused by name before the loss
        from torch.distributed.tensor import Shard, distribute_tensor

        tiled.output.weight = torch.nn.Parameter(distribute_tensor(tiled.output.weight.detach().full_tensor(), mesh, [Shard(1)]))
        with pytest.raises(ValueError, match="serves a vocabulary-parallel LM head"):
            tiled(tokens)
    return True


@pytest.mark.parametrize("loss_par", [True, False], ids=["loss_parallel", "replicated_output"])
def test_tp2_vocabulary_parallel_tiled_head_matches_tp1_untiled(loss_par):
    assert run_ranks(2, _tp_tiled_matches_untiled, loss_par) == [True, True]


def test_tiled_moe_equals_whole_and_counts_tokens_once():
    """torchtitan's MoE layer (top-2 of 4 experts, a shared expert, float64) in tiles of 5 tokens against the
    whole layer: its output, the gradients of the input and of every parameter, and the load-balancing
    statistics (``tokens_per_expert`` after forward + backward: each token counted once, not again when its
    tile is recomputed)."""
    from torchtitan.models.moe import MoE, MoEArgs

    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling

    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=4, top_k=2, use_grouped_mm=False, score_func="softmax"), dim=16, hidden_dim=24)
    with torch.no_grad():
        layer.init_weights(0.1, torch.device("cpu"))
    layer = layer.double()
    model = torch.nn.Module()
    model.output = torch.nn.Linear(16, 8)
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    block = model.layers["0"]
    block.moe_enabled, block.moe = True, copy.deepcopy(layer)
    assert apply_sequence_tiling(model, TILE, tile_moe=True) == (1, 0)
    x = torch.randn(2, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w = torch.randn(2, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for m in (layer, block.moe):
        out = m(x)
        grads = torch.autograd.grad((out * w).sum(), (x, *m.parameters()))
        results.append((out, grads, m.tokens_per_expert.clone()))
    (want, want_grads, want_counts), (got, got_grads, got_counts) = results
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for a, r in zip(got_grads, want_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-13)
    assert want_counts.sum() == 2 * 26 and torch.equal(got_counts, want_counts)


def test_compiled_tiled_blocks_share_one_graph():
    """Note [Tiled blocks under compile]: torchtitan compiles each block alone (fullgraph). With 3 tiled blocks
    under a recompile limit of 2 the blocks must share one graph in training and one under ``no_grad``
    (validation), where a per-block forward compiled one a block and failed at the third; the compiled blocks'
    output = the untiled eager model's (float64)."""
    from torch._dynamo import config as dynamo_config
    from torchtitan.models.llama3 import Transformer, llama3_args

    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling

    args = copy.deepcopy(llama3_args["debugmodel"])  # SDPA (causal), no masks to pass: the blocks compile alone
    args.n_layers, args.vocab_size = 3, 512
    torch.manual_seed(0)
    ref = Transformer(args)
    with torch.no_grad():
        ref.init_weights(buffer_device=torch.device("cpu"))
    ref = ref.double()
    model = copy.deepcopy(ref)
    ref.output = torch.nn.Identity()  # the tiled head passes its input on: compare the hidden states
    assert apply_sequence_tiling(model, TILE) == (3, 0)
    assert type(model.layers["0"].feed_forward).__name__ == "TiledFeedForward"
    assert model.state_dict().keys() == ref.state_dict().keys() | {"output.weight"}  # the module tree unchanged
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend=count, fullgraph=True))
    tokens, _ = _batch()
    with dynamo_config.patch(recompile_limit=2):
        for grad in (True, False, True):
            with torch.set_grad_enabled(grad):
                got, want = model(tokens), ref(tokens)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(graphs) == 2, f"{len(graphs)} graphs for 3 blocks in 2 grad modes"
    torch._dynamo.reset()


@pytest.mark.parametrize("value", [0, -3, 2.5, "yes"])
def test_bad_tile_size_is_rejected(value):
    from cp_dtensor.titan import CPDTensor

    with pytest.raises(ValueError, match=r"\[cp_dtensor\] sequence_tiling must be True, False or a positive int"):
        CPDTensor(sequence_tiling=value)


def test_tile_size_from_the_toml_and_flags():
    from torchtitan.config import ConfigManager

    parse = ConfigManager().parse_args
    assert parse(["--job.config_file", str(CONFIG)]).cp_dtensor.tile_size is None
    assert parse(["--job.config_file", str(CONFIG), "--cp_dtensor.sequence_tiling=64"]).cp_dtensor.tile_size == 64
    assert parse(["--job.config_file", str(CONFIG), "--cp_dtensor.sequence_tiling=True"]).cp_dtensor.tile_size == 1024
    # the TOML's spellings on the command line too
    assert parse(["--job.config_file", str(CONFIG), "--cp_dtensor.sequence_tiling", "true"]).cp_dtensor.tile_size == 1024
    assert parse(["--job.config_file", str(CONFIG), "--cp_dtensor.sequence_tiling", "false"]).cp_dtensor.tile_size is None


@pytest.mark.parametrize("flag", ["--cp_dtensor.tile_size", "--cp-dtensor.tile-size=64"])
def test_tile_size_flag_names_the_right_key(flag):
    from cp_dtensor.titan.shared.options import check_cli_spellings

    check_cli_spellings(["--cp_dtensor.sequence_tiling", "64"])  # the right key passes
    with pytest.raises(ValueError, match=r"no key 'tile_size'; its key is sequence_tiling \(e\.g\. "
                                         r"--cp_dtensor\.sequence_tiling 2048"):
        check_cli_spellings(["--job.config_file", "x.toml", flag, "64"])


@pytest.mark.parametrize(("flags", "world", "message"), [
    (["--parallelism.fsdp_reshard_after_forward", "always"], 2, r'fsdp_reshard_after_forward = "always"'),
])
def test_tiling_refuses_what_it_cannot_serve(flags, world, message):
    from torchtitan.config import ConfigManager

    from cp_dtensor.titan import check_config

    cfg = ConfigManager().parse_args(["--job.config_file", str(CONFIG), "--cp_dtensor.sequence_tiling=64", *flags])
    with pytest.raises(ValueError, match=r"\[cp_dtensor\] sequence_tiling does not support .*" + message):
        check_config(cfg, world_size=world)


def test_loss_without_the_tiled_head_raises():
    from torchtitan.components.loss import cross_entropy_loss

    from cp_dtensor.titan.shared.tiling import tiled_loss

    with pytest.raises(ValueError, match="did not come through the plugin's tiled LM head"):
        tiled_loss(cross_entropy_loss, 8)(torch.randn(1, 4, 16), torch.zeros(1, 4, dtype=torch.long))


def test_non_linear_head_is_refused_by_name():
    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling

    model = torch.nn.Module()
    model.output = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"Module.output is Identity, not an nn.Linear"):
        apply_sequence_tiling(model, 8)


@slow("two end-to-end torchtitan runs (~60-100 s on 2 CPU cores)")
@pytest.mark.parametrize("flags", [[], ["--compile.enable"]], ids=["eager", "compiled"])
def test_cp2_tiled_job_matches_cp1_untiled(flags, tmp_path):
    # the whole job: FSDP over the CP ranks (the head's unsharded weight in the loss), 4 steps; compiled: torchtitan
    # compiles each block (fullgraph) with its tiled, checkpointed MLP inside
    ref = step_losses(reference_run(1, "--parallelism.context_parallel_degree", "1", "--training.steps", "4"), last=4)
    out = torchrun(2, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2", "--cp_dtensor.sequence_tiling=64",
                   "--training.steps", "4", *flags)
    assert "cp_dtensor: sequence tiling, 64 tokens a tile: the LM head + loss and 6 MLPs" in out
    assert step_losses(out, last=4) == pytest.approx(ref, rel=1e-5)


@slow("two end-to-end torchtitan runs (~60-100 s on 2 CPU cores)")
def test_tp2_tiled_job_matches_tp1_untiled(tmp_path):
    # the whole job at TP = 2 (torchtitan's plan, loss parallel): the vocabulary-parallel head tagged past TP's
    # output hook by the plugin's parallelize, the MLPs whole under TP
    ref = step_losses(reference_run(1, "--parallelism.context_parallel_degree", "1", "--training.steps", "4"), last=4)
    out = torchrun(2, tmp_path / "tp2", "--parallelism.context_parallel_degree", "1",
                   "--parallelism.tensor_parallel_degree", "2", "--cp_dtensor.sequence_tiling=64", "--training.steps", "4")
    assert "cp_dtensor: sequence tiling, 64 tokens a tile: the LM head + loss and 0 MLPs (6 MLPs whole under TP)" in out
    assert step_losses(out, last=4) == pytest.approx(ref, rel=1e-5)
