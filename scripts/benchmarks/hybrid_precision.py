"""Precision of a hybrid model under CP with the checkpoints' decay init: CP=1 and CP=2 (fp32, transformers'
torch kernels) each against a float64 reference.

    .venv/bin/python scripts/benchmarks/hybrid_precision.py                       # tiny Qwen3-Next, N = 48 and 256
    .venv/bin/python scripts/benchmarks/hybrid_precision.py --seq-len 256 --layout contiguous

The model: tiny Qwen3-Next (3 Gated DeltaNet + 1 full layer, hidden 64, dk = dv = 16) with transformers'
DEFAULT init (A = exp(A_log) drawn from [0.01, 16]: decays up to ~20 per token). The reference: the same
model in float64 with the delta rule swapped for a float64 token-by-token recurrence (the module-level
``torch_chunk_gated_delta_rule``, as the CP integration swaps it). Its remaining fp32 steps are
transformers' own casts (RMSNorm input, rotary frequencies, the gated norm), relative ~1e-7 on values.
The loss is sum(logits * W) for a fixed random W. Errors: max |a - ref| (abs) and max |a - ref| / max |ref|
(rel), for the logits and every parameter gradient; CP=2 is the sharded run's logits and its gradients
summed over the ranks.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_dist import run_ranks  # noqa: E402

V = 128
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, attn_implementation="sdpa", head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, num_experts=0,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def recurrence64(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                 **_):
    """The gated delta rule token by token in float64 (transformers' kernel signature, GDN scalar gates)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    q, k = (x.repeat_interleave(hv // hk, 2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * dk ** -0.5
    s = v.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.double()
    outs = []
    for t in range(n):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        s = s + beta[:, t][..., None, None] * kt[..., :, None] * (v[:, t] - (s * kt[..., None]).sum(-2))[..., None, :]
        outs.append((s * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, 1), (s if output_final_state else None)


def chunk64():
    """transformers' chunk kernel with its fp32 casts made float64: a second float64 reference (checks the first)."""
    import inspect
    import textwrap

    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    fn = getattr(mod.torch_chunk_gated_delta_rule, "_cp_dtensor_original", mod.torch_chunk_gated_delta_rule)
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[src.index("def "):].replace("torch.float32", "torch.float64")
    scope = dict(vars(mod))
    exec(compile(src, "<chunk64>", "exec"), scope)
    return scope["torch_chunk_gated_delta_rule"]


def model(seed: int = 0):
    """Tiny Qwen3-Next with transformers' default init (the A_log of the checkpoints' recipe), fp32."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).float()


def batch(seed: int, b: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, n), generator=g), torch.randn(b, n, V, generator=g, dtype=torch.float64)


def run(m, tokens, weights, *, mesh=None, layout="headtail"):
    """(logits [B, N, V] float64, {name: grad float64}) of sum(logits * weights), whole or under CP."""
    from cp_dtensor.core.batch import shard_batch, unshard_batch
    from cp_dtensor.doors import reduce_gradients

    n = tokens.shape[1]
    positions = torch.arange(n).expand_as(tokens)
    dtype = next(m.parameters()).dtype
    if mesh is not None:
        tokens, positions, weights = shard_batch((tokens, positions, weights), mesh, layout=layout)
    logits = m(input_ids=tokens, position_ids=positions, use_cache=False).logits
    (logits * weights.to(dtype)).sum().backward()
    if mesh is not None:
        reduce_gradients(m, mesh)
        logits = unshard_batch(logits.detach(), mesh, layout=layout)
    return logits.detach().double(), {k: p.grad.double() for k, p in m.named_parameters()}


def reference64(base, tokens, weights, kernel=recurrence64):
    """The float64 model with a float64 delta rule (the module global, restored after)."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    saved = mod.torch_chunk_gated_delta_rule
    mod.torch_chunk_gated_delta_rule = kernel
    try:
        return run(copy.deepcopy(base).double(), tokens, weights)
    finally:
        mod.torch_chunk_gated_delta_rule = saved


def errors(got, ref) -> dict:
    """{name: (abs, rel)} for the logits and every gradient."""
    (lg, gg), (lr, gr) = got, ref
    out = {"logits": lg}
    out.update(gg)
    refs = {"logits": lr, **gr}
    return {k: ((v - refs[k]).abs().max().item(), ((v - refs[k]).abs().max() / refs[k].abs().max()).item())
            for k, v in out.items()}


def compare(rank: int, world: int, seq_len: int, b: int, layout: str, seed: int):
    """CP=1 fp32, CP=world fp32 and float64 on every rank (the same model and batch): their errors."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.hf import attention as hf

    transformers.logging.set_verbosity_error()
    base = model(seed)
    tokens, weights = batch(seed + 1, b, seq_len)
    ref = reference64(base, tokens, weights)
    ref_check = errors(reference64(base, tokens, weights, chunk64()), ref)
    cp1 = run(copy.deepcopy(base), tokens, weights)
    mesh = init_device_mesh("cpu", (world,))
    cp = run(hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout), tokens, weights, mesh=mesh,
             layout=layout)
    a_max = max(p.exp().max().item() for k, p in base.named_parameters() if k.endswith("A_log"))
    return dict(cp1=errors(cp1, ref), cp=errors(cp, ref), cp_vs_cp1=errors(cp, cp1), a_max=a_max,
                ref_check=max(r for _, r in ref_check.values()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, nargs="+", default=[48, 256])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layout", default="headtail")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all", action="store_true", help="every parameter, not only the worst ten and A_log / dt_bias")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report = {}
    for n in args.seq_len:
        r = run_ranks(args.world, compare, n, args.batch, args.layout, args.seed)[0]
        report[n] = r
        print(f"\ntiny Qwen3-Next, default init (max A = {r['a_max']:.1f}), B={args.batch} N={n}, fp32 torch kernels; "
              f"errors against the float64 model (abs = max|x - ref|, rel = abs / max|ref|); "
              f"CP={args.world} {args.layout}")
        print(f"  {'tensor':<48} {'CP=1 abs':>9} {'CP=1 rel':>9} {'CP abs':>9} {'CP rel':>9} {'CP/CP1':>7} "
              f"{'|CP-CP1| rel':>12}")
        worst = sorted(r["cp"], key=lambda k: -r["cp"][k][1])
        names = list(r["cp"]) if args.all else (["logits"] + [k for k in worst if "A_log" in k or "dt_bias" in k]
                                                + [k for k in worst if k != "logits"][:10])
        for k in dict.fromkeys(names):
            (a1, r1), (a2, r2) = r["cp1"][k], r["cp"][k]
            print(f"  {k:<48} {a1:9.2e} {r1:9.2e} {a2:9.2e} {r2:9.2e} {r2 / max(r1, 1e-30):7.2f} "
                  f"{r['cp_vs_cp1'][k][1]:12.2e}")
        ratio = max(r["cp"][k][1] / max(r["cp1"][k][1], 1e-7) for k in r["cp"])
        print(f"  max over tensors of rel(CP) / max(rel(CP=1), 1e-7): {ratio:.2f}; the two float64 references (recurrence, "
              f"chunk kernel in float64) differ by rel {r['ref_check']:.1e} at most")
    return report


if __name__ == "__main__":
    main()
