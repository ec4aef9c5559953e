"""float8 with context parallelism in torchtitan: torchao's Float8Linear under the ring, and the
``[cp_dtensor] comm_dtype`` float8 K/V payload, end to end on CPU under torchrun.

Float8 linear parity, the tolerance. With torchao's "rowwise" recipe every activation row (one token)
gets its own power-of-two scale, so at CP = 2 each token's linears compute exactly what they compute at
CP = 1: the inputs differ only by the fp32 rounding of attention's summation order (~1e-7), which can
move an element across a float8 rounding boundary only with probability ~1e-7 / 2^-4 per element.
So the step-1 loss (same weights) must agree to rtol 1e-5, the print resolution the fp32 tests use
(measured: identical to all 5 printed decimals). After the first update the weights differ by
summation-order rounding (and by torchao's bf16 rounding of each rank's partial weight gradient) and
float8 rounding amplifies that: once a few roundings flip, two float8 runs drift apart by float8
rounding noise. The yardstick is float8's own effect on the loss, |L_float8 - L_fp32| / L at step 1,
measured 4.2e-4 (rowwise) and 5.2e-4 (tensorwise); CP may use a quarter of it: rtol 1.25e-4 for steps
2-4. Measured CP = 2 vs CP = 1 (rowwise, 6 steps): <= 3.6e-5. torchtitan's default tensorwise recipe
is different: one scale per tensor, from the amax of the *local* shard, so CP re-rounds rank 1's
tokens and the runs differ by float8 noise from step 1 (measured 5.3e-5 at step 1, <= 2.3e-4 to step 4):
its (slow) test allows the whole float8 effect, 5e-4.

The float8 payload changes the loss by its own, smaller rounding: it quantizes only the K/V blocks
that travel. Against the same CP = 2 float8 job without it, the loss must differ at step 1 (it is the
only difference between the two runs) by more than the print resolution, and by less than float8's own
effect on the loss (5e-4). Measured (rowwise): 2.3e-5 at step 1, <= 9.1e-5 after.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist
from _tiers import exhaustive, slow

from _dist import run_ranks
from test_titan import CONFIG, _from_seed, _losses, _parse, _torchrun, seed_ckpt  # noqa: F401  (fixture)

# torchao's emulated gemm (Note [The float8 gemm on CPU]): the recipe's scales and float8 rounding, the product in
# fp32, at a speed that does not depend on the host's oneDNN fp8 path; the real gemm: test_real_cpu_float8_gemm
F8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise",
      "--quantize.linear.float8.emulate"]
EMULATED = "float8 linears on CPU use torchao's emulated gemm (recipe rowwise kept"
PAYLOAD = ["--cp_dtensor.comm_dtype", "float8_e4m3fn"]
STEP1_RTOL = 1e-5  # identical per-token math: the fp32 tests' print-resolution bar
FP8_LOSS_EFFECT = 5e-4  # |L_float8 - L_fp32| / L at step 1, measured 4.2e-4 (rowwise) .. 5.2e-4 (tensorwise)
LATER_RTOL = FP8_LOSS_EFFECT / 4
PRINT_RES = 1.3e-6  # 5 printed decimals of a loss near 8


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_parity(losses: list[float], ref: list[float]) -> None:
    rel = [_rel(a, b) for a, b in zip(losses, ref)]
    print(f"float8 CP vs CP=1: losses {losses} vs {ref}, rel {[f'{r:.1e}' for r in rel]}")  # shown with -s
    assert rel[0] <= STEP1_RTOL and max(rel[1:]) <= LATER_RTOL, f"CP {losses} vs CP=1 {ref}: rel {rel}"


@pytest.fixture(scope="module")
def cp1_float8(seed_ckpt, tmp_path_factory) -> list[float]:
    out = _torchrun(1, tmp_path_factory.mktemp("cp1_f8"), "--parallelism.context_parallel_degree", "1", *F8,
                    *_from_seed(seed_ckpt))
    assert "Float8 training active with recipe rowwise" in out and "float8 linears run on CPU" in out
    assert EMULATED in out
    return _losses(out)


@pytest.fixture(scope="module")
def cp2_float8(seed_ckpt, tmp_path_factory) -> list[float]:
    out = _torchrun(2, tmp_path_factory.mktemp("cp2_f8"), *F8, *_from_seed(seed_ckpt))
    assert "Applied cp_dtensor ring attention (layout=striped) to the model; K/V ring payload as the input" in out
    assert out.count(EMULATED) == 2  # one line a rank
    return _losses(out)


@slow("two torchtitan jobs: ~15 s")
def test_cp2_float8_linears_match_cp1(cp1_float8, cp2_float8):
    _assert_parity(cp2_float8, cp1_float8)


@slow("one more torchtitan job: ~9 s")
def test_toml_comm_dtype_reaches_the_ring(seed_ckpt, cp2_float8, tmp_path):
    out = _torchrun(2, tmp_path, *F8, *PAYLOAD, *_from_seed(seed_ckpt))
    assert "K/V ring payload comm_dtype=float8_e4m3fn" in out
    rel = [_rel(a, b) for a, b in zip(_losses(out), cp2_float8)]
    print(f"float8 payload vs none: rel {[f'{r:.1e}' for r in rel]}")  # shown with -s
    assert rel[0] > 3 * PRINT_RES, f"the float8 payload did not change the loss: rel {rel}"
    assert max(rel) < FP8_LOSS_EFFECT, f"the float8 payload moved the loss more than float8 linears do: {rel}"


_SLOW = slow("60-150 s on 2 CPU cores")
_ALL = exhaustive("60-150 s on 2 CPU cores; not in CI")


@_SLOW
def test_cp2_float8_tiled_matches_untiled_with_the_head_filtered(seed_ckpt, cp1_float8, tmp_path):
    # Note [float8 and the tiled LM head]: the tiled job says at start that "output" joins filter_fqns, and is then
    # the untiled float8 job with that filter (the head in fp32, every other linear float8)
    ref = _losses(_torchrun(1, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1", *F8,
                            "--quantize.linear.float8.filter_fqns", "output", *_from_seed(seed_ckpt)))
    out = _torchrun(2, tmp_path / "cp2", *F8, "--cp_dtensor.sequence_tiling", "true", *_from_seed(seed_ckpt))
    assert out.count('"output" joins [quantize.linear.float8] filter_fqns') == 2  # one warning a rank
    _assert_parity(_losses(out), ref)
    assert _rel(ref[0], cp1_float8[0]) > 3 * PRINT_RES  # the filter is what makes them equal: a float8 head differs


@_SLOW
def test_cp2_float8_compiled_matches_cp1(seed_ckpt, cp1_float8, tmp_path):
    # torchtitan compiles each block (fullgraph): Float8Linear's casts and the ring in one Inductor graph
    _assert_parity(_losses(_torchrun(2, tmp_path, *F8, "--compile.enable", *_from_seed(seed_ckpt))), cp1_float8)


@_ALL
def test_cp2_float8_payload_compiled(seed_ckpt, cp1_float8, tmp_path):
    # the payload's float8 encode / decode inside the compiled blocks, next to Float8Linear's casts
    rel = [_rel(a, b) for a, b in zip(
        _losses(_torchrun(2, tmp_path, *F8, *PAYLOAD, "--compile.enable", *_from_seed(seed_ckpt))), cp1_float8)]
    print(f"compiled float8 payload vs CP=1 without: rel {[f'{r:.1e}' for r in rel]}")  # shown with -s
    assert rel[0] > 3 * PRINT_RES and max(rel) < FP8_LOSS_EFFECT, rel


@_ALL
def test_cp4_float8_matches_cp1(seed_ckpt, cp1_float8, tmp_path):
    out = _torchrun(4, tmp_path, "--parallelism.context_parallel_degree", "4", *F8, *_from_seed(seed_ckpt))
    _assert_parity(_losses(out), cp1_float8)


@_ALL
def test_cp2_float8_tensorwise_within_float8_noise(seed_ckpt, tmp_path):
    # tensorwise scales come from each rank's local amax: CP re-rounds, see the module docstring
    tw = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
    ref = _losses(_torchrun(1, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1", *tw,
                            *_from_seed(seed_ckpt)))
    losses = _losses(_torchrun(2, tmp_path / "cp2", *tw, *_from_seed(seed_ckpt)))
    rel = [_rel(a, b) for a, b in zip(losses, ref)]
    print(f"tensorwise CP vs CP=1: rel {[f'{r:.1e}' for r in rel]}")  # shown with -s
    assert max(rel) <= FP8_LOSS_EFFECT, f"tensorwise CP {losses} vs CP=1 {ref}: rel {rel}"


# ---- in-process: the option's parsing, its wiring into the ring, and the CPU float8 hook ----

def test_bad_comm_dtype_is_rejected_at_parse(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.read_text().replace('layout = "striped"', 'layout = "striped"\ncomm_dtype = "fp8"', 1))
    msg = r"\[cp_dtensor\] comm_dtype must be one of bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 .*got 'fp8'"
    with pytest.raises(ValueError, match=msg):
        _parse(bad)
    with pytest.raises(ValueError, match=msg):
        from cp_dtensor.titan import CPDTensor

        CPDTensor(comm_dtype="fp8")
    assert _parse(CONFIG).cp_dtensor.comm_torch_dtype is None  # unset: K/V travel as they are


def test_tiled_head_joins_the_float8_filter_and_a_converted_head_is_refused():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from cp_dtensor.titan.shared.float8 import keep_tiled_head_unconverted
    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling

    cfg = _parse(CONFIG, *F8, "--cp_dtensor.sequence_tiling", "true", "--quantize.linear.float8.filter_fqns", "wq")
    assert keep_tiled_head_unconverted(cfg) == ["quantize.linear.float8"]
    assert cfg.quantize.linear.float8.filter_fqns == ["wq", "output"]
    assert keep_tiled_head_unconverted(cfg) == []  # once
    assert keep_tiled_head_unconverted(_parse(CONFIG, "--cp_dtensor.sequence_tiling", "true")) == []  # no float8
    model = torch.nn.Module()
    model.output = torch.nn.Linear(32, 64)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    with pytest.raises(ValueError, match=r"converted to Float8Linear, .* Add 'output' to the converter's filter_fqns"):
        apply_sequence_tiling(model, 8)


def test_old_float8_converter_name_is_explained():
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, "--model.converters", "float8")  # torchtitan itself would fail with KeyError: 'float8'
    with pytest.raises(ValueError, match=r'no converter "float8"; .* converters = \["quantize.linear.float8"\]'):
        check_config(cfg, world_size=2)


def _wire_bytes(rank, world, comm_dtype):
    from torchtitan.models.llama3 import Transformer, llama3_args

    from cp_dtensor.titan import apply_ring_attention
    from cp_dtensor.tools.debug import CommBytes

    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])
    # what the plugin's parallelize function does with the parsed [cp_dtensor] section
    cfg = types.SimpleNamespace(layout="striped", comm_torch_dtype=comm_dtype, ulysses_degree=1, kv_exchange="ring")
    apply_ring_attention(model, types.SimpleNamespace(get_group=lambda: dist.group.WORLD), cfg)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(2, 4, 16, 64, generator=g, dtype=torch.bfloat16) for _ in range(3))
    with CommBytes() as cb:
        model.layers["0"].attention.inner_attention(q, k, v)
    return cb.by_op["all_to_all_single"]


@pytest.mark.parametrize(("value", "per_row"), [(None, 2 * 64), ("bfloat16", 2 * 64), ("float8_e4m3fn", 64 + 1)])
def test_toml_comm_dtype_sets_bytes_on_the_wire(tmp_path, value, per_row):
    # bytes per K/V row: bf16 inputs, D = 64; float8 sends D bytes plus one int8 exponent per row
    toml = tmp_path / "cfg.toml"
    line = "" if value is None else f'\ncomm_dtype = "{value}"'
    toml.write_text(CONFIG.read_text().replace('layout = "striped"', 'layout = "striped"' + line, 1))
    comm_dtype = _parse(toml).cp_dtensor.comm_torch_dtype
    sent = run_ranks(2, _wire_bytes, comm_dtype)
    assert sent == [(2 - 1) * 2 * 2 * 4 * 16 * per_row] * 2  # (P-1) * {K,V} * B * Hkv * S_local * bytes per row


def test_float8_converter_builds_on_cpu_even_compiled():
    # torchtitan refuses float8 without an SM89+ GPU unless emulated and uncompiled; the plugin's hook
    # lets the real converter (torch._scaled_mm, compile allowed) build here. See Note [float8 training on CPU].
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.distributed import ParallelDims

    from cp_dtensor.titan.shared.float8 import SCALED_MM_LIMIT, cpu_scaled_mm_cost

    if torch.accelerator.is_available():
        pytest.skip("the hook applies only without an accelerator")
    cfg = _parse(CONFIG, "--model.converters", "quantize.linear.float8", "--compile.enable")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    converter = Float8LinearConverter(cfg, dims)
    ratio, _ = cpu_scaled_mm_cost()  # the real gemm where this CPU runs it fast: Note [The float8 gemm on CPU]
    assert converter.enabled and converter.config.emulate == (ratio is None or ratio > SCALED_MM_LIMIT)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
    converter.convert(model)
    assert type(model[0]).__name__ == "Float8Linear"
    x = torch.randn(16, 32, requires_grad=True)
    model(x).sum().backward()  # float8 forward and backward on the CPU
    assert x.grad is not None and model[0].weight.grad is not None


def _converter(monkeypatch, cost, *flags):
    """torchtitan's float8 converter built on CPU with the probe answering ``cost``; (converter, warnings)."""
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.distributed import ParallelDims

    import cp_dtensor.titan.shared.float8 as f8

    warned: list[str] = []
    monkeypatch.setattr(f8, "cpu_scaled_mm_cost", lambda: cost)
    monkeypatch.setattr(f8.logger, "warning", warned.append)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return Float8LinearConverter(_parse(CONFIG, "--model.converters", "quantize.linear.float8", *flags), dims), warned


@pytest.mark.parametrize(("cost", "flags", "emulated", "warns"), [
    ((2.4, "fast"), (), False, False),  # the real gemm where the host runs it at a few fp32 matmuls
    ((900.0, "oneDNN's reference path"), (), True, True),  # unusably slow: emulate, one warning
    ((None, "cannot create the primitive"), (), True, True),
    ((2.4, "fast"), ("--quantize.linear.float8.emulate",), True, False),  # asked for: no probe, no warning
], ids=["fast", "slow", "missing", "asked"])
@pytest.mark.parametrize("recipe", ["rowwise", None])
def test_cpu_float8_gemm_choice(monkeypatch, cost, flags, emulated, warns, recipe):
    # Note [The float8 gemm on CPU]: emulation keeps the recipe (torchtitan 0.2.2 would drop emulate with one)
    from torchao.float8 import Float8LinearConfig

    if torch.accelerator.is_available():
        pytest.skip("the choice applies only without an accelerator")
    named = ("--quantize.linear.float8.recipe_name", recipe) if recipe else ()
    converter, warned = _converter(monkeypatch, cost, *flags, *named)
    want = Float8LinearConfig.from_recipe_name(recipe) if recipe else Float8LinearConfig()
    assert converter.config == dataclasses.replace(want, emulate=emulated)
    assert len(warned) == warns and (not warns or cost[1] in warned[0] and "emulated gemm" in warned[0])


@slow("the real CPU fp8 gemm: seconds where oneDNN's fp8 path is slow")
def test_real_cpu_float8_gemm_equals_emulated():
    # What this measures: torch._scaled_mm on this CPU (oneDNN's fp8 gemm, whatever its speed) computes
    # torchao's rowwise Float8Linear forward and backward as the emulated gemm does, to fp32 summation order:
    # both multiply the same float8-rounded, power-of-two-scaled operands. Tiny, so it fits any host.
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    x, gy = torch.randn(32, 64), torch.randn(32, 64)  # one grad_output for both: float8 rounds the same inputs
    lin = torch.nn.Linear(64, 64, bias=False)
    outs = []
    for emulate in (False, True):
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
        f8 = Float8Linear.from_float(torch.nn.Linear(64, 64, bias=False), config=cfg)
        f8.weight.data.copy_(lin.weight.data)
        xi = x.clone().requires_grad_()
        y = f8(xi)
        y.backward(gy)
        outs.append((y.detach(), xi.grad, f8.weight.grad))
    # the real gemm rounds its products to bf16 on this path (torchao's rowwise output); the emulated one keeps
    # fp32: they differ by about bf16's rounding, 2^-9 of the largest element (measured <= 2.9e-3; 2^-8 allowed)
    errs = [((real - emulated).abs().max() / emulated.abs().max()).item() for real, emulated in zip(*outs)]
    print(f"real vs emulated CPU float8 gemm (out, dx, dW): rel {[f'{e:.1e}' for e in errs]}")  # shown with -s
    assert max(errs) <= 2**-8, errs
    ref = x @ lin.weight.t()
    err = ((outs[0][0] - ref).abs().max() / ref.abs().max()).item()
    assert 1e-3 < err < 0.1, err  # float8 rounding ran (e4m3: a few per cent), not an fp32 matmul


def test_float8_moe_grouped_gemm_still_refused_on_cpu():
    # Bad input: a float8 recipe this host cannot run. torch._scaled_grouped_mm has no CPU kernel, so the
    # plugin's yes answers the dense linears' converter only (Note [float8 training on CPU]): the grouped-GEMM
    # converter keeps torchtitan's refusal, raised on every rank when the trainer builds its converters
    from torchtitan.components.quantization.float8 import Float8GroupedMMConverter, has_cuda_capability
    from torchtitan.distributed import ParallelDims

    if torch.accelerator.is_available():
        pytest.skip("the refusal applies only without an accelerator")
    cfg = _parse(CONFIG, "--model.converters", "quantize.grouped_mm.float8")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    with pytest.raises(ValueError, match="Float8 MoE training only supported on SM89 or later"):
        Float8GroupedMMConverter(cfg, dims)
    assert not has_cuda_capability(8, 9)  # the module's own check is torchtitan's outside the dense build
