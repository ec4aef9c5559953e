"""gpu_check's model sections: tiny transformers models built locally (no hub) at CP = 2 against CP = 1 in
bf16 on one packed row of documents, each with a time limit; and sequence tiling's LM head + loss (memory
and time, tiled vs not, against float64).

A bf16 model under CP cannot equal its CP = 1 run bit for bit, so both are compared with the CP = 1 run in
fp32 (the same weights): CP = 2 passes when its error is within 2x CP = 1's own bf16 error + 2e-2, and
nothing is non-finite. The last case is the one an H200 run saw stall (issue 53): gpt-oss (sinks, windows,
MoE; 2 layers) at CP = 2, bf16, striped, one packed row of 1024 tokens -- with its time limit it reports
"slow" when it finishes late, and the launcher's watchdog dumps every rank's stacks when it never does
(the stall watchdog in _gpu_ranks.py)."""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from _gpu_ranks import compare, last_line, progress, record, worst

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def build(name: str, window: int, top_k: int = 4):
    """The tiny model ``name`` ("llama" or "gpt-oss"), fp32 on the CPU, the same weights on every rank.
    gpt-oss routes each token to ``top_k`` of its 4 experts: with all 4 no bf16 rounding flips a routing
    decision, so bf16 stays within ~1e-2 of fp32 (top 2: ~0.2 from flipped routes alone)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attn_implementation="sdpa"))
    cfg = transformers.GptOssConfig(**{**TINY, "intermediate_size": 64}, attn_implementation="eager",
                                    num_local_experts=4, num_experts_per_tok=top_k, sliding_window=window)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks large enough to matter (initialised near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def packed_lengths(n: int) -> list[int]:
    """One row of documents: a long one (> N / 2), mid-sized ones and a 1-token one, summing to ``n``."""
    cuts = [n // 2 + 3, n // 8 + 1, 1, n // 16 + 5]
    return [*cuts, n - sum(cuts)]


def _dense_masks(lengths: list[int], window: int, device) -> dict:
    """gpt-oss's prepared masks for one packed row (its modeling code builds no packed-sequence mask): additive
    [1, 1, N, N] per layer type, block-diagonal causal (and windowed)."""
    n = sum(lengths)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    i, j = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    full = (ids[:, None] == ids[None, :]) & (j <= i)
    add = lambda keep: torch.zeros(n, n, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]  # noqa: E731
    return {"full_attention": add(full), "sliding_attention": add(full & (i - j < window))}


def _run(model, tokens, positions, weights, *, masks=None, mesh=None, layout=None):
    """logits and every parameter's gradient of sum(logits * weights); under CP the batch is sharded and
    the logits put back together."""
    from cp_dtensor.core.batch import shard_batch, unshard_batch
    from cp_dtensor.doors import reduce_gradients

    if mesh is None:
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=masks, use_cache=False).logits
        (logits.float() * weights).sum().backward()
        return logits.detach().float(), [p.grad.float() for p in model.parameters()]
    extra = {}
    if layout == "documents":
        from cp_dtensor import hf

        layout = hf.plan_batch(model, position_ids=positions.cpu())
        extra = {"cp_layout": layout}
    tok, pos, w = shard_batch((tokens, positions, weights), mesh, layout=layout)
    logits = model(input_ids=tok, position_ids=pos, use_cache=False, **extra).logits
    (logits.float() * w).sum().backward()
    reduce_gradients(model, mesh)
    return unshard_batch(logits.detach().float(), mesh, layout=layout), [p.grad.float() for p in model.parameters()]


def model_case(cfg, rank, world, device, name, layout, n, limit_s, *, window=None, top_k=4) -> dict:
    """CP = world in bf16 vs CP = 1 in bf16, both against CP = 1 in fp32, on one packed row of ``n`` tokens
    (gpt-oss: a window of ``window`` tokens, default N / 8, ``top_k`` experts a token)."""
    from torch.distributed.device_mesh import DeviceMesh

    from cp_dtensor import hf

    window = window or max(4, n // 8)
    base = build(name, window, top_k)
    lengths = packed_lengths(n)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (1, n), generator=g).to(device)
    positions = torch.cat([torch.arange(x) for x in lengths])[None].to(device)
    weights = torch.randn(1, n, TINY["vocab_size"], generator=g).to(device)
    masks = _dense_masks(lengths, window, device) if name == "gpt-oss" else None
    ref = _run(copy.deepcopy(base).to(device), tokens, positions, weights, masks=masks)
    one = _run(copy.deepcopy(base).to(device, torch.bfloat16), tokens, positions, weights,
               masks=None if masks is None else {k: m.to(torch.bfloat16) for k, m in masks.items()})
    mesh = DeviceMesh(device.type, list(range(world)))
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout).to(device, torch.bfloat16)
    progress(f"start models {name} {layout} N={n}: CP={world} forward + backward (limit {limit_s} s)")
    t0 = time.perf_counter()
    cp = _run(model, tokens, positions, weights, mesh=mesh, layout=layout)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    names = ["logits"] + [f"grad {k}" for k, _ in base.named_parameters()]
    res_cp = [compare(a, b) for a, b in zip([cp[0], *cp[1]], [ref[0], *ref[1]])]
    res_one = [compare(a, b) for a, b in zip([one[0], *one[1]], [ref[0], *ref[1]])]
    err_cp, err_one = worst(r["err"] for r in res_cp), worst(r["err"] for r in res_one)
    nonfinite = {m: r["nonfinite"] for m, r in zip(names, res_cp) if r["nonfinite"]}
    worst_name = names[max(range(len(names)), key=lambda i: res_cp[i]["err"])]
    ok = err_cp <= 2 * err_one + 2e-2 and not nonfinite and seconds <= limit_s
    return dict(err_cp=err_cp, err_cp1_bf16=err_one, worst_tensor=worst_name, nonfinite=nonfinite,
                nonfinite_total=sum(nonfinite.values()), worst=err_cp, seconds=seconds, limit_s=limit_s,
                status="ok" if seconds <= limit_s else "slow", ok=ok)


def model_sections(cfg, rank, world, device):
    """Every model case, the stall case last; a case that raises is one failed row."""
    n, big = cfg["model_seq_len"], cfg["stall_seq_len"]
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # an image without transformers: said in the report, not a wrong answer
        record("models", dict(model="-", layout="-", seq_len=0, case="transformers not installed", status="unavailable",
                              error=last_line(e), worst=None, ok=True))
        return
    limit = cfg["model_limit_s"]
    cases = [("llama", "striped", n, limit, {}), ("llama", "documents", n, limit, {}),
             ("gpt-oss", "striped", n, limit, {}), ("gpt-oss", "documents", n, limit, {}),
             # issue 53's stall, as the test suite builds gpt-oss (window 5, top 2 of 4 experts): 90 s on a GPU
             ("gpt-oss", "striped", big, cfg["stall_limit_s"], dict(window=5, top_k=2))]
    for name, layout, length, limit, kw in cases:
        row = dict(model=name, layout=layout, seq_len=length, case=f"{name} {layout} N={length}"
                   + (f" (window {kw['window']}, top {kw['top_k']} experts)" if kw else ""))
        try:
            record("models", dict(row, **model_case(cfg, rank, world, device, name, layout, length, limit, **kw)))
        except Exception as e:  # noqa: BLE001 -- the same on every rank: report, go on
            record("models", dict(row, worst=float("inf"), ok=False, status="error", error=last_line(e)))


def tiling_check(device, *, tokens: int, hidden: int, vocab: int, tile: int, iters: int) -> dict:
    """cp_dtensor.linear_cross_entropy (tiled) vs F.linear + F.cross_entropy (untiled), bf16 weights and
    hidden: loss and gradients against float64, peak memory above the inputs (CUDA) and median time."""
    from cp_dtensor.core.tiling import linear_cross_entropy

    g = torch.Generator().manual_seed(5)
    h64 = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * hidden**-0.5
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = -100

    def untiled(h, w):
        return F.cross_entropy(F.linear(h, w).float(), labels.to(h.device), ignore_index=-100)

    def tiled(h, w):
        return linear_cross_entropy(h, w, labels.to(h.device), tile_size=tile)

    def run(fn, dtype):
        h, w = (x.to(device, dtype, copy=True).requires_grad_() for x in (h64, w64))
        loss = fn(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    want = run(untiled, torch.float64)
    rows = {}
    for label, fn in (("untiled", untiled), ("tiled", tiled)):
        progress(f"start tiling {label}")
        got = run(fn, torch.bfloat16)
        res = {m: compare(a, b) for m, a, b in zip(("loss", "dhidden", "dweight"), got, want)}
        peak, times = None, []
        for _ in range(iters):
            h, w = (x.to(device, torch.bfloat16, copy=True).requires_grad_() for x in (h64, w64))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn(h, w).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            times.append(time.perf_counter() - t0)
        times.sort()
        w_ = worst(r["err"] for r in res.values())
        rows[label] = dict(errors={m: r["err"] for m, r in res.items()}, worst=w_, peak_bytes=peak,
                           seconds=times[len(times) // 2], ok=w_ <= 3e-2)
    return dict(tokens=tokens, hidden=hidden, vocab=vocab, tile=tile, rows=rows,
                ok=all(r["ok"] for r in rows.values()))
