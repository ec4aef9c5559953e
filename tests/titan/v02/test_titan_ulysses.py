"""torchtitan with ``[cp_dtensor] ulysses_degree`` and ``kv_exchange`` (Note [Ulysses in torchtitan]).

Default tier (no torchrun): the start-up refusals (U not dividing the CP degree, U not dividing the
query heads a TP rank holds, bad values), and the (ulysses, ring) mesh of real CP groups on 8 gloo
ranks (dp 2 x cp 4, U = 2): mesh[u, r] = CP rank r * U + u, and the batch shard ``shard_cp_batch``
gives each rank is the one ``ring_attention`` expects, its index in ``mesh.mesh.flatten()``.

Slow tier (CP_DTENSOR_SLOW=1): CP = 4 as U = 2 x R = 2 logs CP = 1's losses for steps 1-3 to rel
2e-5: llama3 debugmodel (MHA) headtail with the all-gather, qwen3 debugmodel (GQA 16 / 8 heads,
tied-embedding FSDP over the CP ranks) striped with the ring, and qwen3 at CP 2 (U = 2, R = 1) x TP 2
(8 local heads, 4 per Ulysses rank). ~3 min on a quiet machine. Measured here (steps 1-3): llama3
U 2 x R 2 striped ring and headtail all-gather both equal CP = 1 to the 5 printed decimals; sharding
the batch by CP rank instead of the mesh's row-major index moves step 1 by 5.6e-5 and step 3 by 3.8e-4.
"""

from __future__ import annotations

import importlib.util

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _dist import run_ranks  # noqa: E402
from _titan_run import CONFIG, step_losses, torchrun  # noqa: E402  the one launcher

STEPS, RTOL = 3, 2e-5


def _parse(*overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(CONFIG), *overrides])


def _cp(cp: int, u: int, *more: str) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(cp), "--cp_dtensor.ulysses_degree", str(u), *more]


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (_cp(4, 3), 4, r"ulysses_degree \(3\) must divide context_parallel_degree \(4\)"),
        (_cp(1, 2), 2, r"ulysses_degree \(2\) must divide context_parallel_degree \(1\)"),
        # llama3 debugmodel: 16 query heads, 4 per TP rank at TP 4; U = 8 cannot split 4
        (_cp(8, 8, "--parallelism.tensor_parallel_degree", "4"), 32,
         r"n_heads = 16, tensor_parallel_degree = 4, so 4 heads per TP rank. Use a ulysses_degree that divides 4"),
        (_cp(32, 32), 32, r"so 16 heads per TP rank. Use a ulysses_degree that divides 16"),
    ],
)
def test_bad_ulysses_config_is_rejected(overrides, world, message):
    from cp_dtensor.titan import check_config

    with pytest.raises(ValueError, match=message):
        check_config(_parse(*overrides), world_size=world)


def test_good_ulysses_configs_pass():
    from cp_dtensor.titan import check_config

    check_config(_parse(*_cp(4, 2, "--parallelism.tensor_parallel_degree", "2")), world_size=8)  # 8 heads / TP rank
    check_config(_parse(*_cp(4, 4, "--cp_dtensor.kv_exchange", "allgather")), world_size=4)  # R = 1
    check_config(_parse(*_cp(4, 2, "--model.name", "qwen3", "--model.flavor", "debugmodel")), world_size=4)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("ulysses_degree", 0, r"ulysses_degree must be an integer >= 1; got 0"),
    ("kv_exchange", "p2p", r"kv_exchange must be one of ring, allgather; got 'p2p'"),
])
def test_bad_section_values_are_rejected(field, value, message):
    from cp_dtensor.titan import CPDTensor

    with pytest.raises(ValueError, match=message):
        CPDTensor(**{field: value})


def _mesh_and_shards(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.core.plan.layout import local_positions
    from cp_dtensor.titan.shared.heads import ulysses_mesh
    from cp_dtensor.titan.v02.attention import shard_cp_batch

    cp_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))["cp"]
    mesh = ulysses_mesh(cp_mesh, 2)
    flat = mesh.mesh.flatten().tolist().index(rank)  # ring_attention's index of this rank (row-major)
    inputs = torch.arange(32).repeat(2, 1)  # [B, N]: token = its global position
    out = {}
    for layout in ("striped", "headtail", "contiguous"):
        x, _, kw = shard_cp_batch(inputs, inputs, {}, cp_mesh, torch.device("cpu"), layout=layout, ulysses=2)
        want = local_positions(layout=layout, rank=flat, cp_size=4, seq_len=32)
        out[layout] = torch.equal(x[0], want) and torch.equal(kw["positions"][0], want)
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names, "flat": flat,
            "cp_rank": cp_mesh.get_local_rank(), **out}


def test_ulysses_mesh_is_fast_varying_and_batch_follows_it():
    results = run_ranks(8, _mesh_and_shards, timeout=120)
    for rank, res in enumerate(results):
        base = 4 * (rank // 4)  # this rank's CP group: base .. base + 3
        assert res["mesh"] == [[base + 0, base + 2], [base + 1, base + 3]], res  # [u, r] = CP rank r * 2 + u
        assert res["names"] == ("cp_ulysses", "cp_ring")
        c = res["cp_rank"]
        assert res["flat"] == (c % 2) * 2 + c // 2
        assert res["striped"] and res["headtail"] and res["contiguous"], res


# ---- slow tier: end to end against CP = 1 ----

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """family -> (its overrides, CP = 1 losses), made on first use. No seed checkpoint: the plugin
    initialises the weights on an unsharded replica, the same at every CP / FSDP / TP degree (Note
    [torchtitan on CPU] 6), which these runs check too."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            over = [*(QWEN3 if family == "qwen3" else []), "--training.steps", str(STEPS)]
            out = torchrun(1, tmp_path_factory.mktemp(family), *over, "--parallelism.context_parallel_degree", "1")
            cp1 = step_losses(out, last=STEPS)
            assert min(cp1[1:]) < cp1[0], f"the reference run does not train: {cp1}"
            made[family] = over, cp1
        return made[family]

    return get


@pytest.mark.parametrize(("family", "extra", "banner"), [
    pytest.param("llama3", _cp(4, 2, "--cp_dtensor.layout", "headtail", "--cp_dtensor.kv_exchange", "allgather"),
                 "layout=headtail, ulysses=2 x ring=2, kv_exchange=allgather)", marks=exhaustive()),
    pytest.param("qwen3", _cp(4, 2), "layout=striped, ulysses=2 x ring=2)", marks=slow()),
    pytest.param("qwen3", _cp(2, 2, "--parallelism.tensor_parallel_degree", "2"), "layout=striped, ulysses=2 x ring=1)",
                 marks=exhaustive()),
], ids=["llama3-u2r2-allgather-headtail", "qwen3-u2r2", "qwen3-u2r1-tp2"])
def test_ulysses_matches_cp1(family, extra, banner, refs, tmp_path):
    over, cp1 = refs(family)
    out = torchrun(4, tmp_path, *over, *extra, timeout=900)
    assert f"Applied cp_dtensor ring attention ({banner}" in out, out[-3000:]
    losses = step_losses(out, last=STEPS)
    assert losses == pytest.approx(cp1, rel=RTOL), f"U x R losses {losses} vs CP = 1 {cp1}"
