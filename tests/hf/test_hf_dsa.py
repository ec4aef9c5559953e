"""DeepSeek Sparse Attention under CP (cp_dtensor/hf/sparse.py, sparse_generate.py): tiny random DeepSeek-V3.2 and
GLM-MoE-DSA models (index_topk < N, so the selection matters) at CP = 2 and 3, every layout, against the same
model at CP=1 (transformers' own sdpa / eager path): the indexer's selected index sets identical, logits and
every gradient within 1e-5, the loss equal; generate() from the sharded cache (one call, three turns, a chunked
prefill): greedy tokens identical; what the scheme does not serve raises on every rank."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from _tiers import SLOW

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from cp_dtensor.core.batch import shard_batch, unshard_batch  # noqa: E402
from cp_dtensor.doors import reduce_gradients  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf import latent, served, sparse, sparse_attend  # noqa: E402
from cp_dtensor.hf.documents import plan_batch  # noqa: E402
from _conformance import build  # noqa: E402

TOL = 1e-5
N, B, V, K = 24, 2, 64, 8  # K: the tiny configs' index_topk, a third of N
FAMILIES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
MLA = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}  # dense MLA: hf/latent.py
MLA_PROVEN = latent.PROVEN
LAYOUTS = ("headtail", "striped", "contiguous")


def _model(kind: str, impl: str = "sdpa", ties: bool = False):
    model, built = build(kind, FAMILIES[kind])
    assert built == "sdpa" and model.config.index_topk == K < N
    if kind == "glm_moe_dsa":  # layer 1 reuses layer 0's selection (GLM's "shared" indexer layers)
        cfg = copy.deepcopy(model.config)
        cfg.indexer_types = ["full", "shared"]
        torch.manual_seed(0)
        model = type(model)(cfg).float().train()
    model.set_attn_implementation(impl)  # eager: the indexer's mask additive, as transformers' eager mask is
    if ties:  # every index score 0: each query's whole prefix ties, topk's own order decides (CP=1's, on rows alike)
        for m in sparse.dsa_layers(model):
            torch.nn.init.zeros_(m.indexer.weights_proj.weight)
    return model


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, V, (B, N), generator=g)
    labels = tokens.clone()
    labels[1, :4] = -100
    return tokens, torch.arange(N).expand(B, N), labels


_TILING = [False]  # inside a tiled indexer call (_tiny_bounds): its tiles are recorded as one call


def _record(model) -> list:
    """The indexers' top-k outputs, one entry a call (forward hooks; a tiled call's picks once)."""
    picks = []

    def hook(mod, args, kwargs, out):
        if not _TILING[0]:
            picks.append(out)

    for m in sparse.dsa_layers(model):
        if m.indexer is not None:
            m.indexer.register_forward_hook(hook, with_kwargs=True)
    return picks


def _plain(model):
    picks = _record(model)
    tokens, positions, labels = _batch()
    out = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, picks


def _cp(model, mesh, layout, use_cache: bool = False, **options):
    picks = _record(model)
    cp = hf.apply_context_parallel(model, mesh, layout=layout, **options)
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)
    out = cp(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab,
             num_items_in_batch=(shifted != -100).sum(), use_cache=use_cache)
    out.loss.backward()
    reduce_gradients(cp, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    logits = unshard_batch(out.logits.detach().contiguous(), mesh, layout=layout)
    picks = [unshard_batch(p.contiguous(), mesh, layout=layout) for p in picks]
    grads = {n: p.grad for n, p in cp.named_parameters() if p.grad is not None}
    return cp, loss, logits, grads, picks


def _masked(plain, mesh, case: str, **options) -> dict:
    """"padded": row 0 left-padded by 5, row 1 right-padded by 3 (labels -100 there), striped; "packed": row 0 two
    documents, row 1 three (position ids that restart), headtail; "documents": documents of unequal lengths (3, 14,
    7 and 10, 5, 9) under layout="documents" (each row in its plan's order, short documents whole on a rank);
    "documents padded": the padded batch under layout="documents"; "packed plan" / "padded plan": those batches
    with their plan under the named layout (plan_batch of a headtail / striped model, cp_layout=). The logits (pad rows too: a left-pad row sees
    no key, as at CP=1), every gradient and the loss against CP=1 with the same mask or positions."""
    tokens, positions, labels = _batch()
    mask, layout = torch.ones(B, N, dtype=torch.long), "striped"
    padded, planned, named_plan = "padded" in case, case.startswith("documents"), case.endswith("plan")
    if padded:
        mask[0, :5] = 0
        mask[1, -3:] = 0
        labels = labels.masked_fill(mask == 0, -100)
    elif case.startswith("packed"):
        positions = torch.stack([torch.cat([torch.arange(10), torch.arange(N - 10)]),
                                 torch.cat([torch.arange(7), torch.arange(9), torch.arange(N - 16)])])
        layout = "headtail"
    else:
        positions = torch.stack([torch.cat([torch.arange(3), torch.arange(14), torch.arange(N - 17)]),
                                 torch.cat([torch.arange(10), torch.arange(5), torch.arange(N - 15)])])
    kw = dict(attention_mask=mask) if padded else {}
    ref = copy.deepcopy(plain)
    picks = _record(ref)
    want = ref(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False, **kw)
    want.loss.backward()
    model = copy.deepcopy(plain)
    got_picks = _record(model)
    cp = hf.apply_context_parallel(model, mesh, layout="documents" if planned else layout, **options)
    if planned or named_plan:  # the batch's plan, from the full batch: Note [One plan per batch in transformers]
        layout = plan_batch(cp, position_ids=positions, **kw)
        assert padded or named_plan or not torch.equal(layout.order[0], layout.order[1])  # each row its own order
        assert layout.placement == ("documents" if planned else "striped" if padded else "headtail")
    shifted = hf.shift_labels(labels)
    tok, pos, lab, am = shard_batch((tokens, positions, shifted, mask), mesh, layout=layout)
    got = cp(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab,
             num_items_in_batch=(shifted != -100).sum(), use_cache=False, **({"attention_mask": am} if kw else {}),
             **({"cp_layout": layout} if planned or named_plan else {}))
    got.loss.backward()
    reduce_gradients(cp, mesh)
    loss = got.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    logits = unshard_batch(got.logits.detach().contiguous(), mesh, layout=layout)
    got_picks = [unshard_batch(p.contiguous(), mesh, layout=layout) for p in got_picks]
    valid = [torch.gather(_allowed(positions, mask, case), -1, p.long()) for p in picks]  # CP=1's valid picks
    same = all(torch.equal(a.long()[v], b.long()[v]) for a, b, v in zip(got_picks, picks, valid))
    grads = {n: p.grad for n, p in cp.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return dict(picks=same, loss=abs(loss.item() - want.loss.item()) / abs(want.loss.item()),
                logits=rel_err(logits, want.logits.detach()),
                grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))


def _dynamic_batch(dp: int):
    """dp ranks' rows of packed documents [dp * B, N] (tokens, positions, shifted labels), some ignored labels."""
    lengths = [[24], [3, 14, 7], [2, 3, 19], [10, 5, 9], [20, 4], [1, 1, 22], [12, 12], [6, 18]]
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, V, (dp * B, N), generator=g)
    positions = torch.stack([torch.cat([torch.arange(x) for x in row]) for row in lengths[:dp * B]])
    labels = tokens.clone()
    labels[1, :4] = -100
    return tokens, positions, hf.shift_labels(labels)


def _dynamic(plain, world: int, cp: int) -> dict:
    """shard_batch(..., dynamic=True): one plan of the global batch (every dp rank's rows end to end) over the
    dp x cp grid (cp 1: a 1-D mesh, every rank its own rows), the model over the flattened mesh with it; against
    CP=1 on the global batch's rows (Note [DSA rows of CP=1's length]: each query's index row CP=1's): the index sets,
    the loss (summed over the global count), the logits, every gradient (summed over the grid)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor._compat import mesh_flatten

    dp, rank = world // cp, torch.distributed.get_rank()
    grid = init_device_mesh("cpu", (world,)) if cp == 1 else init_device_mesh("cpu", (dp, cp), mesh_dim_names=(
        "dp", "cp"))
    flat = grid if cp == 1 else mesh_flatten(grid)
    tokens, positions, shifted = _dynamic_batch(dp)
    count = (shifted != -100).sum()

    def loss_of(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / count

    ref = copy.deepcopy(plain)
    ref_picks = _record(ref)
    want = ref(input_ids=tokens, position_ids=positions, use_cache=False).logits
    want_loss = loss_of(want, shifted)
    want_loss.backward()
    mine = slice(rank // cp * B, rank // cp * B + B)  # this dp rank's rows
    (tok, pos, lab), plan, mesh = shard_batch((tokens[mine], positions[mine], shifted[mine]), grid, layout="documents",
                                              dynamic=True, position_ids=positions[mine])
    cp_model = hf.apply_context_parallel(copy.deepcopy(plain), flat, layout="documents")
    picks, by_rows = [], sparse.by_rows

    def record(*args, **kwargs):  # the grouped indexer's picks [1, S, K], global positions
        picks.append(by_rows(*args, **kwargs))
        return picks[-1]

    sparse.by_rows = record
    try:
        got = cp_model(input_ids=tok, position_ids=pos, use_cache=False, cp_layout=plan).logits
    finally:
        sparse.by_rows = by_rows
    loss = loss_of(got, lab)
    loss.backward()
    reduce_gradients(cp_model, flat)
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss, group=flat.get_group())
    logits = unshard_batch(got.detach().contiguous(), mesh, layout=plan).view(dp * B, N, -1)
    start = (torch.arange(dp * B) * N)[:, None, None]  # each row's first global position
    picks = [unshard_batch(p.contiguous(), mesh, layout=plan).view(dp * B, N, -1).long() - start for p in picks]
    valid = [torch.gather(_allowed(positions, None, "packed"), -1, p.long()) for p in ref_picks]
    grads = {n: p.grad for n, p in cp_model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return dict(picks=len(picks) == len(ref_picks) and plan.cp_size == world and all(
                    torch.equal(a[v], b.long()[v]) for a, b, v in zip(picks, ref_picks, valid)),
                loss=abs(loss.item() - want_loss.item()) / abs(want_loss.item()), logits=rel_err(logits, want.detach()),
                grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))


def _bf16(plain, mesh, ref_loss, ref_logits) -> dict:
    """bf16 weights, and fp32 weights under bf16 autocast: CP (headtail) and CP=1 alike against the fp32 CP=1 run
    (``ref_loss``, ``ref_logits``).
    The first layer's picks (scored in fp32 from the embeddings) are CP=1's; later layers' index scores come from
    hidden states rounded in another order (the selected keys' attention), so a near-tie may flip there, as bf16
    CP=1 flips against fp32 (docs/transformers.md: 0.7 % of query rows vs 3 %); the loss and logits stay in CP=1's
    rounding class."""
    import contextlib

    out = {}
    for mode in ("weights", "autocast"):
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
        model = copy.deepcopy(plain).to(torch.bfloat16) if mode == "weights" else copy.deepcopy(plain)
        with ctx():
            loss1, logits1, _, picks1 = _plain(copy.deepcopy(model))
            _, loss2, logits2, _, picks2 = _cp(copy.deepcopy(model), mesh, "headtail")
        err = lambda loss: abs(loss.float().item() - ref_loss.item()) / abs(ref_loss.item())  # noqa: E731
        out[mode] = dict(picks=torch.equal(picks1[0].long(), picks2[0].long()), loss=(err(loss1), err(loss2)),
                         logits=(rel_err(logits1.float(), ref_logits), rel_err(logits2.float(), ref_logits)))
    return out


def _allowed(positions, mask, case: str) -> torch.Tensor:
    """[B, N, N]: the keys each query sees at CP=1 (causal; the pads masked, or the own document only)."""
    causal = torch.ones(N, N, dtype=torch.bool).tril()[None].expand(positions.shape[0], -1, -1)
    if "padded" in case:
        return causal & mask.bool()[:, None, :]
    docs = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    return causal & (docs[:, None, :] == docs[:, :, None])


def _raises(fn, match: str) -> str:
    try:
        fn()
    except ValueError as e:
        assert match in str(e), str(e)
        return "raised"
    return "ran"


def _tiny_bounds(on: bool) -> None:
    """The memory bounds of DSA's attention chunks and indexer tiles forced to one query (on), or put back."""
    from cp_dtensor.hf import sparse_rows

    def tiled(indexer, *args):  # the training forward's tiled indexer call, recorded as one call (_record)
        _TILING[0] = True
        try:
            out = sparse_rows.index_tiles(indexer, *args)
        finally:
            _TILING[0] = False
        for hook in indexer._forward_hooks.values():
            hook(indexer, args, {}, out)
        return out

    if on:
        _tiny_bounds.saved = sparse_attend._GATHERED, sparse_rows._INDEX_SCORES
    sparse_attend._GATHERED, sparse_rows._INDEX_SCORES = (1, 1) if on else _tiny_bounds.saved
    sparse.index_tiles = tiled if on else sparse_rows.index_tiles


def _ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    extra = [("deepseek_v32", "eager"), ("deepseek_v32", "ties"), ("glm_moe_dsa", "checkpointing"),
             ("deepseek_v32", "ties tiles"), ("glm_moe_dsa", "eager tiles")]  # tiles: the memory bounds forced tiny
    for kind, impl in [(k, "sdpa") for k in FAMILIES] + extra:
        plain = _model(kind, "eager" if impl.startswith("eager") else "sdpa", ties=impl.startswith("ties"))
        if impl.endswith("tiles"):  # one query a chunk and an indexer tile (Notes [DSA attention in query chunks],
            _tiny_bounds(True)  # [The DSA indexer in query tiles]); the padded and dynamic batches below too
        if impl == "checkpointing":  # the backward recomputes each layer: its gather and exchange run again
            plain.gradient_checkpointing_enable()
        ref_loss, ref_logits, ref_grads, ref_picks = _plain(copy.deepcopy(plain))
        for layout in LAYOUTS if impl == "sdpa" else ("headtail", "striped"):
            cp, loss, logits, grads, picks = _cp(copy.deepcopy(plain), mesh, layout)
            assert len(picks) == len(ref_picks) >= 1
            same = all(torch.equal(a.long(), b.long()) for a, b in zip(picks, ref_picks))
            out[kind, impl, layout] = dict(
                picks=same, loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                logits=rel_err(logits, ref_logits),
                grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))
            hf.remove_context_parallel(cp)  # the layers' own forward back
            out[kind, impl, layout, "removed"] = "ran" if all("forward" not in vars(m) for m in sparse.dsa_layers(cp)) \
                else "left"
        if impl == "eager":  # its loss scores a left pad, which CP=1's eager path averages over the row: refused
            out[kind, "eager padded"] = _raises(lambda: _masked(plain, mesh, "padded"), "uniform average")
        if impl.endswith("tiles"):  # blind rows and masked picks; by_rows' grouped indexer, rows of several lengths
            out[kind, impl, "padded"] = _masked(_model(kind) if "eager" in impl else plain, mesh, "padded")
            out[kind, impl, "dynamic"] = _dynamic(plain, world, 1)
            _tiny_bounds(False)
        if impl != "sdpa":
            continue
        plan = "packed plan" if kind == "deepseek_v32" else "padded plan"  # a named layout's plan: one each
        for case in ("padded", "packed", "documents", "documents padded", plan):
            out[kind, case] = _masked(plain, mesh, case)
        if kind == "deepseek_v32" or world > 2:  # the 1-D mesh: every rank brings its own rows (GLM: slow tier)
            out[kind, "dynamic"] = _dynamic(plain, world, 1)
        if kind == "deepseek_v32" and world == 2:
            out[kind, "bf16"] = _bf16(plain, mesh, ref_loss, ref_logits)  # against the fp32 CP=1 run above
        # what the scheme does not serve: refused on every rank, before any row moves
        tokens, positions, _ = _batch()
        tok, pos = shard_batch((tokens, positions), mesh, layout="headtail")
        cp = hf.apply_context_parallel(copy.deepcopy(plain), mesh, layout="headtail")
        out[kind, "cache"] = _raises(lambda: cp(input_ids=tok, position_ids=pos, use_cache=True), "without a KV cache")
        kernel = copy.deepcopy(plain)
        kernel.config._attn_implementation_internal = "kernels-community/flash-mla"  # as loaded with that kernel
        out[kind, "flash-mla"] = _raises(lambda: hf.apply_context_parallel(kernel, mesh), "flash-mla")
        plan = plan_batch(cp, position_ids=_dynamic_batch(1)[1])  # a named layout's plan of another batch
        out[kind, "named plan"] = _raises(lambda: cp(input_ids=tok, position_ids=pos, use_cache=False, cp_layout=plan),
                                          "built for another batch")
        docs = hf.apply_context_parallel(copy.deepcopy(plain), mesh, layout="documents")  # and none in documents
        out[kind, "no plan"] = _raises(lambda: docs(input_ids=tok, position_ids=pos, use_cache=False), "plan_batch")
        for m in sparse.dsa_layers(cp):  # what a config with attention_dropout=0.1 builds
            m.attention_dropout = 0.1
        out[kind, "dropout"] = _raises(lambda: cp(input_ids=tok, position_ids=pos, use_cache=False),
                                       "config.attention_dropout = 0")
    _mla_cases(mesh, out)
    _trainer_ddp(rank, world, out)
    return out


def _trainer_ddp(rank: int, world: int, out: dict) -> None:
    """The Trainer with activation checkpointing (DDP then runs without find_unused_parameters) on a DSA model,
    whose indexers never get a gradient: refused on every rank when it is built, not a DDP failure at step 2."""
    import tempfile

    from transformers import Trainer, TrainingArguments, default_data_collator

    from cp_dtensor.hf import with_context_parallel

    _env(rank, world)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, gradient_checkpointing=True)
    rows = [{"input_ids": list(range(3, 3 + N)), "labels": list(range(3, 3 + N))}] * 4
    cls = with_context_parallel(Trainer, cp_size=world)
    out["glm_moe_dsa", "trainer checkpointing"] = _raises(
        lambda: cls(model=_model("glm_moe_dsa"), args=args, train_dataset=rows, data_collator=default_data_collator),
        "ddp_find_unused_parameters=True")


def _mla_cases(mesh, out: dict) -> None:
    """Dense MLA with the latents on the wire (Note [MLA latents on the wire] in cp_dtensor/hf/latent.py), in key
    chunks of 5 tokens and query tiles of 4 (the recomputed expansion runs several chunks a rank): every layout, left and right padding,
    packed documents, layout="documents" (padded too), eager and activation checkpointing, against CP=1, with
    kv_exchange="latent" (opt-in); the latent path is the one taken (``mla``); without it the ring; asked for a
    model, kernel or option it does not serve, refused at the door on every rank."""
    from cp_dtensor.hf import latent_attend
    import _conformance as conformance

    latent_attend.key_chunk = lambda *shape: 5  # this rank process only: several key chunks and query tiles
    latent_attend.query_tile = lambda *shape: 4
    for kind, impl in [(k, "sdpa") for k in MLA] + [("deepseek_v3", "eager"), ("deepseek_v3", "checkpointing")]:
        plain, _ = build(kind, MLA[kind])
        plain.set_attn_implementation("eager" if impl == "eager" else "sdpa")
        if impl == "checkpointing":  # the backward recomputes each layer: its gather runs again
            plain.gradient_checkpointing_enable()
        ref_loss, ref_logits, ref_grads, _ = _plain(copy.deepcopy(plain))
        for layout in LAYOUTS + ("use_cache",) if impl == "sdpa" else ("headtail",):  # use_cache=True: one forward
            cached = layout == "use_cache"  # with a fresh cache (its latents handed on), striped
            cp, loss, logits, grads, _ = _cp(copy.deepcopy(plain), mesh, "striped" if cached else layout, cached,
                                             kv_exchange="latent")
            assert cp._cp_dtensor_hf.mla == "latent", cp._cp_dtensor_hf.mla
            out[kind, impl, layout] = dict(
                picks=True, loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                logits=rel_err(logits, ref_logits),
                grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))
            hf.remove_context_parallel(cp)
            out[kind, impl, layout, "removed"] = "ran" if all("expand_kv" not in vars(m) for m in cp.modules()) \
                else "left"
        if impl == "eager":  # a scored left pad, which CP=1's eager path averages over the row: refused (pads.py)
            out[kind, "eager padded"] = _raises(lambda: _masked(plain, mesh, "padded", kv_exchange="latent"),
                                                "uniform average")
        if impl != "sdpa":
            continue
        for case in ("padded", "packed", "documents", "documents padded"):
            out[kind, case] = _masked(plain, mesh, case, kv_exchange="latent")
    ring = hf.apply_context_parallel(copy.deepcopy(plain), mesh)  # the default: the ring on the expanded K/V
    out["mla default", "removed"] = "ran" if "kv_exchange='ring'" in ring._cp_dtensor_hf.mla and all(
        "expand_kv" not in vars(m) for m in ring.modules()) else "left"
    latent_door = partial(hf.apply_context_parallel, mesh=mesh, kv_exchange="latent")
    llama, _ = build("llama", conformance.families()["llama"])
    out["mla latent", "llama"] = _raises(lambda: latent_door(llama), "has no dense multi-head latent attention")
    out["mla latent", "dsa"] = _raises(lambda: latent_door(_model("deepseek_v32")), "model_type in ['axk1'")
    kernel = copy.deepcopy(plain)
    kernel.config._attn_implementation_internal = "flash_attention_2"  # as loaded with that kernel
    out["mla latent", "kernel"] = _raises(lambda: latent_door(kernel), "attn_implementation='flash_attention_2'")
    out["mla latent", "comm_dtype"] = _raises(lambda: latent_door(copy.deepcopy(plain), comm_dtype=torch.bfloat16),
                                              "comm_dtype=torch.bfloat16")
    out["mla latent", "typo"] = _raises(lambda: latent_door(copy.deepcopy(plain), kv_exchange="Latent"),
                                        "one of 'ring', 'allgather', 'latent'")  # the door's values, not the ring's
    cfg = conformance.tiny_config("deepseek_v3")  # a float64 model (dense: transformers' grouped experts take no
    cfg.first_k_dense_replace = 2  # float64): the kernels' float64 lse and float64 accumulation
    torch.manual_seed(0)
    dense = getattr(transformers, MLA["deepseek_v3"])(cfg).double().train()
    dense.set_attn_implementation("sdpa")
    ref_loss, ref_logits, ref_grads, _ = _plain(copy.deepcopy(dense))
    _, loss, logits, grads, _ = _cp(copy.deepcopy(dense), mesh, "striped", kv_exchange="latent")
    out["deepseek_v3", "float64"] = dict(
        picks=True, loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), logits=rel_err(logits, ref_logits),
        grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))
    world = mesh.size()
    for kind in sorted(latent.PROVEN - set(MLA)):  # the other proven families: P = 2 headtail (LongCat, slow: 4 s
        if kind == "longcat_flash" and world == 2:  # a run), P = 3 every layout they take
            continue
        plain, _ = build(kind, conformance.families()[kind])
        ref_loss, ref_logits, ref_grads, _ = _plain(copy.deepcopy(plain))
        hybrid = "linear_attention" in (getattr(plain.config, "layer_types", None) or ())
        for layout in ("headtail",) if world == 2 else ("headtail", "contiguous") if hybrid else LAYOUTS:
            cp, loss, logits, grads, _ = _cp(copy.deepcopy(plain), mesh, layout, kv_exchange="latent")
            assert cp._cp_dtensor_hf.mla == "latent", (kind, cp._cp_dtensor_hf.mla)
            out[kind, "sdpa", layout] = dict(
                picks=True, loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                logits=rel_err(logits, ref_logits),
                grads=sorted(grads) == sorted(ref_grads) and max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))


def _generate(model, ids, mask=None):
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                    pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    return out.sequences, torch.stack(out.scores)


def _generate_ranks(rank, world):
    """generate() from the sharded cache: greedy tokens identical to CP=1's, every step's logits within 1e-5
    (a prompt of 13 tokens, padded by the layouts' unit, and a left-padded row; 21 columns in the end against
    index_topk = 8)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(3, V, (B, 13), generator=torch.Generator().manual_seed(5))
    left = torch.ones(B, 13, dtype=torch.long)
    left[0, :4] = 0  # row 0 left-padded: 9 tokens
    out = {}
    for kind, ties in [("deepseek_v32", False), ("glm_moe_dsa", False), ("deepseek_v32", True)]:
        plain = _model(kind, ties=ties)
        for mask in (None, left) if not ties else (None,):
            prompt = ids if mask is None else ids.masked_fill(mask == 0, 0)
            want, want_scores = _generate(copy.deepcopy(plain), prompt, mask)
            layouts = ("striped",) if ties else ("headtail", "striped") if world == 2 else LAYOUTS
            if kind == "deepseek_v32" and not ties:  # layout="documents": the prompt prefilled striped
                layouts = (*layouts, "documents")
            for layout in layouts:
                cp = hf.apply_context_parallel(copy.deepcopy(plain), mesh, layout=layout)
                got, scores = _generate(cp, prompt, mask)
                out[kind, ties, mask is None, layout] = (torch.equal(got, want), rel_err(scores, want_scores))
    out["turns"] = _turns(mesh, world)
    return out


def _follow(ids, mask, seed: int, lens):
    """The conversation so far [B, M] and follow-ups of ``lens`` tokens (one a row), each padded on the left to the
    longest (padding inside the conversation)."""
    g, t = torch.Generator().manual_seed(seed), max(lens)
    new, real = torch.zeros(ids.shape[0], t, dtype=torch.long), torch.zeros(ids.shape[0], t, dtype=mask.dtype)
    for row, n in enumerate(lens):
        new[row, t - n:], real[row, t - n:] = torch.randint(3, V, (n,), generator=g), 1
    ones = torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)
    return torch.cat([ids, new], 1), torch.cat([mask, ones, real], 1)


_TURN_CASES = [(k, "") for k in FAMILIES] + [("deepseek_v32", "ties"), ("glm_moe_dsa", "eager")]  # P > 2: all


class _Fail:
    """A stopping criterion that raises at its ``at``-th call: a turn that fails midway (Note [Transactional turns])."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("stopped")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class _SentBytes:
    """Counts what this rank receives in each layer of a sharded DSA turn (the collectives of hf/sparse_turn.py and
    hf/sparse.py, but the positions' once-a-forward gather), beside the bound of the rule that chose the turn."""

    def __enter__(self):
        import torch.distributed as dist

        from cp_dtensor.hf import sparse_generate, sparse_turn

        self.layers, self.plans, self.on, self.saved = [], [], False, []

        def patch(owner, name, new):
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)

        forward, plan, a2a, gather = (sparse_generate.sharded_forward, sparse_turn.dsa_turn_plan,
                                      dist.all_to_all_single, sparse_turn.all_gather_single)

        def counted(*args, **kwargs):
            self.on = True
            self.layers.append(0)
            try:
                return forward(*args, **kwargs)
            finally:
                self.on = False

        def planned(**kwargs):
            self.plans.append(plan(**kwargs))
            return self.plans[-1]

        def all_to_all(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            if self.on:  # the own split stays here
                own = (out_splits or [out.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group))
                row = out.element_size() * (out[0].numel() if out.shape[0] else 0)  # 0 rows: nothing came
                self.layers[-1] += out.numel() * out.element_size() - own[dist.get_rank(group)] * row
            return a2a(out, inp, out_splits, in_splits, group=group, **kw)

        def all_gather(x, dim, group):
            if self.on and x.is_floating_point():  # the index keys (the int64 positions: once a forward)
                self.layers[-1] += x.numel() * x.element_size() * (dist.get_world_size(group) - 1)
            return gather(x, dim, group)

        patch(sparse_generate, "sharded_forward", counted)
        patch(sparse_turn, "dsa_turn_plan", planned)
        patch(dist, "all_to_all_single", all_to_all)
        patch(sparse_turn, "all_gather_single", all_gather)
        return self

    def __exit__(self, *exc):
        for owner, name, old in reversed(self.saved):
            setattr(owner, name, old)

    def verdict(self):
        """None without a sharded forward; else whether every layer received something, at most the bound."""
        bound = [p.sharded for p in self.plans if p.mode == "sharded"]
        if not self.layers:
            return None
        return len(bound) == 1 and all(0 < x <= bound[0] for x in self.layers)


def _turns(mesh, world: int) -> dict:
    """Four turns of a conversation (batch 2, a left-padded row) from the sharded cache -- follow-ups of 3 tokens
    (one row's 1, padded: pass-Q, the index scores gathered), 2N + 1 (one row's 2N - 2: a sharded turn, Note
    [Sharded DSA turns], with the layout's pad columns and padding inside the conversation; the cache outgrows
    index_topk) and 9 (pass-Q, the index keys gathered) -- a turn that fails midway then retried, and a
    prefill in chunks of 8 (at P = 3 sharded) (both families; at P > 2 also a model whose index scores all tie and the eager
    implementation under layout='documents'): greedy tokens identical to CP=1's (transformers continuing its own cache, prefilling in the
    same chunks: a chunk's index rows are shorter than the whole prompt's, and topk breaks the index scores' ties
    over the row) and every step's logits within 1e-5."""
    from test_hf_generate import _generate as _gen
    from test_hf_generate import _prompt
    from transformers import StoppingCriteriaList

    def compare(got, ref, where):  # tokens identical; every step's logits, the largest relative error
        out[where] = (torch.equal(got.sequences, ref.sequences),
                      max(rel_err(a, b) for a, b in zip(got.logits, ref.logits)) if len(got.logits) == len(
                          ref.logits) else float("inf"))

    out = {}
    sparse_attend._GATHERED = 4096  # a sharded turn attends in query chunks of 2 (4 heads x 8 picks x 24 x batch 2 a query)
    if world == 2:  # every indexer call in query tiles of one (Note [The DSA indexer in query tiles]); P = 3: the one call
        from cp_dtensor.hf import sparse_rows

        sparse_rows._INDEX_SCORES = 1
    for i, (kind, variant) in enumerate(_TURN_CASES[:len(_TURN_CASES) if world > 2 else 2]):
        layout = ("striped", "headtail", "contiguous", "documents")[i if world > 2 else i % 2]  # documents: the
        # prompt striped, the turns as for every layout
        plain = _model(kind, "eager" if variant == "eager" else "sdpa", ties=variant == "ties").eval()
        kind = f"{kind} {variant}".strip()
        ref_model = copy.deepcopy(plain)
        cp = hf.apply_context_parallel(copy.deepcopy(plain), mesh, layout=layout)
        ids, mask = _prompt(1, B, 11, [2, 0], low=3, vocab=V)
        ref, got = _gen(ref_model, ids, mask, max_new_tokens=3), _gen(cp, ids, mask, max_new_tokens=3)
        compare(got, ref, (kind, "turn 1"))
        for turn, lens in enumerate(((3, 1), (2 * N + 1, 2 * N - 2), (9, 9)), 2):
            ids, mask = _follow(got.sequences, mask, turn, lens)
            if turn == 3:  # a turn that fails after its first token: the cache (index keys too) as it was
                fail = StoppingCriteriaList([_Fail(2)])
                out[kind, "failed turn"] = _raises_any(lambda: _gen(cp, ids, mask, cache=got.cache, max_new_tokens=3,
                                                                    stopping_criteria=fail))
            ref = _gen(ref_model, ids, mask, cache=ref.cache, max_new_tokens=3)
            with _SentBytes() as sent:  # a sharded forward's layers receive at most the rule's bound
                got = _gen(cp, ids, mask, cache=got.cache, max_new_tokens=3)
            out[kind, f"turn {turn} bytes"] = sent.verdict()
            compare(got, ref, (kind, f"turn {turn}"))
        out[kind, "runs"] = dict(got.cache.runs)  # and how many layer forwards gathered the index keys (the long turn)
        out[kind, "gathered"] = vars(got.cache)["_cp_dtensor_index_keys"].get("gathered", 0)
        ids, mask = _prompt(2, B, 29, [3, 0], low=3, vocab=V)
        compare(_gen(cp, ids, mask, prefill_chunk_size=8, max_new_tokens=3),
                _gen(copy.deepcopy(plain), ids, mask, prefill_chunk_size=8, max_new_tokens=3), (kind, "chunked prefill"))
    return out


def _raises_any(fn) -> str:
    try:
        fn()
    except RuntimeError:
        return "raised"
    return "ran"


def _check_generate(world):
    results = run_ranks(world, _generate_ranks, timeout=600)
    assert all(r == results[0] for r in results)
    turns = results[0].pop("turns")
    for key, got in results[0].items():
        assert got[0] and got[1] <= TOL, (key, got)
    kinds = [f"{k} {v}".strip() for k, v in _TURN_CASES[:len(_TURN_CASES) if world > 2 else 2]]
    for kind in kinds:
        assert turns.pop((kind, "failed turn")) == "raised"
        runs = turns.pop((kind, "runs"))
        # the 49-token turn's first forward sharded (Note [Sharded DSA turns]; the failed try's count restored),
        # every other one pass-Q (the rule of dsa_turn_plan)
        assert runs.pop("pass-kv") == 1 and set(runs) == {"prefill", "decode"}, runs
        assert turns.pop((kind, "gathered")) == (1 if "glm" in kind else 2)  # the 9-token turn's first forward
        # gathers the index keys (pass-Q); the 3-token turn gathers scores
        for turn in (2, 3, 4):  # the sharded forward's bytes: at most the rule's bound, in every layer
            assert turns.pop((kind, f"turn {turn} bytes")) == (True if turn == 3 else None), (kind, turn)
    assert len(turns) == 5 * len(kinds)
    for key, (same, err) in turns.items():
        assert same and err <= TOL, (key, same, err)


def _check(world):
    results = run_ranks(world, _ranks, timeout=600)
    for r in results:
        assert r == results[0]
    for key, got in results[0].items():
        if isinstance(got, str):
            assert got == ("ran" if "removed" in key else "raised"), key
            continue
        if "bf16" in key:  # bf16 (weights, autocast) vs fp32: CP in CP=1's rounding class (measured 2e-5 / 7e-2)
            for mode, (picks, (_, loss2), (logits1, logits2)) in ((m, tuple(g.values())) for m, g in got.items()):
                assert picks and loss2 <= 1e-3 and logits2 <= 1.5 * logits1 + 1e-2, (key, mode, got[mode])
            continue
        assert got["picks"], (key, "the selected index sets differ from CP=1's")
        if "float64" in key:  # float64 all through (the loss: transformers' cross-entropy upcasts to fp32 only)
            assert got["logits"] <= 1e-12 and got["grads"] is not False and got["grads"] <= 1e-12, (key, got)
        loss_tol = 1e-6 if key[0] in MLA_PROVEN else TOL  # dense MLA: the loss to 1e-6 (relative)
        assert got["loss"] <= loss_tol and got["logits"] <= TOL and got["grads"] is not False and got["grads"] <= TOL, \
            (key, got)


def test_dsa_cp2():
    _check(2)


@pytest.mark.skipif(not SLOW, reason="slow tier (CP_DTENSOR_SLOW=1)")
def test_dsa_cp3():
    _check(3)


def _dynamic_ranks(rank, world, cp: int):
    """cp 2 (dp 2 x cp 2): shard_batch(dynamic=True) against CP=1 (both families, the all-ties model), then
    with_context_parallel(Trainer, layout="documents", dynamic=True); cp 1: the plain Trainer on the 2 replicas."""
    import tempfile

    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from cp_dtensor.hf import with_context_parallel

    out = {}
    if cp > 1:
        out = {kind: _dynamic(_model(kind), world, cp) for kind in FAMILIES}
        out["deepseek_v32 ties"] = _dynamic(_model("deepseek_v32", ties=True), world, cp)  # every index score tied
        out["deepseek_v32 eager"] = _dynamic(_model("deepseek_v32", "eager"), world, cp)  # the additive mask
    _env(rank, world)
    g = torch.Generator().manual_seed(2)
    docs = [{"input_ids": torch.randint(3, V, (int(torch.randint(2, 21, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(18)]  # 3 a row: each replica's rows of another length (padded to the longest over the grid)
    for kind in FAMILIES:
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=3,
                                 logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-2, use_cpu=True,
                                 disable_tqdm=True, seed=0, data_seed=0)
        cls = with_context_parallel(Trainer, cp_size=cp, layout="documents", dynamic=True) if cp > 1 else Trainer
        trainer = cls(model=_model(kind), args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening())
        trainer.train()
        out[kind, "trainer"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        out[kind, "planned over"] = getattr(getattr(trainer, "_cp_meta", None), "plan", None) is not None and \
            trainer._cp_meta.plan.cp_size
    return out


@pytest.mark.skipif(not SLOW, reason="slow tier (CP_DTENSOR_SLOW=1): 4 + 2 ranks, ~20 s")
def test_dsa_dynamic_dp2_cp2():
    """dynamic CP on a dp 2 x cp 2 grid (4 ranks): shard_batch(..., dynamic=True) with both families, the
    all-ties model and the eager implementation against CP=1 on the global batch (the default tier runs the 1-D grid of 2 ranks inside
    test_dsa_cp2, the slow one of 3 in test_dsa_cp3); with_context_parallel(Trainer, layout="documents",
    dynamic=True) on packed documents logs the plain Trainer's losses on the 2 replicas (within 1e-4)."""
    results = run_ranks(4, _dynamic_ranks, 2, timeout=600)
    want = run_ranks(2, _dynamic_ranks, 1, timeout=600)[0]
    for kind in FAMILIES:
        for r in results:
            got, ref = r.pop((kind, "trainer")), want[kind, "trainer"]
            assert len(got) == len(ref) == 3 and max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4, (kind, got, ref)
            assert r.pop((kind, "planned over")) == 4
    assert all(r == results[0] for r in results)
    for kind, got in results[0].items():
        assert got["picks"], (kind, "the selected index sets differ from CP=1's")
        assert got["loss"] <= TOL and got["logits"] <= TOL and got["grads"] is not False and got["grads"] <= TOL, \
            (kind, got)


def test_dsa_generate_cp2():
    _check_generate(2)


@pytest.mark.skipif(not SLOW, reason="slow tier (CP_DTENSOR_SLOW=1)")
def test_dsa_generate_cp3():
    _check_generate(3)


def test_door_refuses_kernels():
    """flash-mla's sparse path raises at the door, before anything is changed; every layout is served; the served
    families are the same set in the door and the scheme."""
    assert served._DSA == sparse.FAMILIES
    model = _model("deepseek_v32")
    assert "flash-mla" in sparse.door_error(model, "headtail", {"": "kernels-community/flash-mla"})
    for layout in (*LAYOUTS, "documents"):
        assert sparse.door_error(model, layout, {"": "sdpa"}) is None


def test_exchange_plan_requests_only_rows_held_elsewhere():
    """The plan's requests: each selected valid (row, key) not held by the rank, once, grouped by owner."""
    from cp_dtensor.core.plan.layout import global_order

    order = global_order("headtail", 2, 8)  # rank 0 holds 0, 1, 6, 7
    picks = torch.tensor([[[2, 3, 0], [7, 2, 4]]])  # [B=1, S=2, K=3]
    valid = torch.tensor([[[True, True, False], [True, True, False]]])
    rows, owners = sparse.exchange_plan(picks, valid, order, rank=0, world=2)
    assert rows.tolist() == [2, 3] and owners.tolist() == [1, 1]
    # a plan's order, row by row (layout="documents"): row 1's rank 0 holds 2, 3, 4, 5
    orders = torch.stack([order, torch.tensor([2, 3, 4, 5, 0, 1, 6, 7])])
    picks = torch.tensor([[[2, 3], [7, 2]], [[0, 7], [2, 4]]])  # [B=2, S=2, K=2]
    rows, owners = sparse.exchange_plan(picks, torch.ones_like(picks, dtype=torch.bool), orders, rank=0, world=2)
    assert rows.tolist() == [2, 3, 8 + 0, 8 + 7] and owners.tolist() == [1, 1, 1, 1]


def _env(rank: int, world: int) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # what torchrun sets; accelerate reads it


def _trainer_ranks(rank, world, cp: bool) -> dict:
    """transformers' Trainer, 3 steps of fixed-length rows, of packed documents (DataCollatorWithFlattening), or of
    padded rows (DataCollatorForLanguageModeling, right or left padding, CP's own padding after it): plain (one
    process) or with_context_parallel (headtail / striped; packed documents and left padding also under
    layout="documents")."""
    import tempfile

    from test_hf_trainer import _tokenizer
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from cp_dtensor.hf import with_context_parallel

    _env(rank, world)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": list(ids)} for ids in (torch.randint(3, V, (N,), generator=g).tolist()
                                                                for _ in range(12))]
    docs = [{"input_ids": torch.randint(3, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(16)]  # packed by the collator into rows of 4 documents, often of odd length (CP pads)
    texts = [{"input_ids": torch.randint(3, V, (int(torch.randint(6, 21, (1,), generator=g)),), generator=g).tolist()}
             for _ in range(12)]  # rows of 6..20 tokens, padded to each batch's longest, then by CP to its layout's unit
    out = {}
    for kind, packed, layout in [(k, p, "headtail") for k in FAMILIES for p in (False, True)] + [
            ("deepseek_v32", True, "documents"),  # the collator plans each packed batch (layout="documents")
            ("deepseek_v32", "right", "headtail"), ("glm_moe_dsa", "left", "striped"),
            ("deepseek_v32", "left", "documents"),  # padded rows (DataCollatorForLanguageModeling)
            ("glm_moe_dsa", "checkpointing", "headtail")]:  # the indexers get no gradient: DDP finds them unused
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3,
                                 logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-2, use_cpu=True,
                                 disable_tqdm=True, seed=0, data_seed=0, gradient_checkpointing=packed == "checkpointing",
                                 ddp_find_unused_parameters=True if packed == "checkpointing" else None)
        cls = with_context_parallel(Trainer, cp_size=world, layout=layout) if cp else Trainer
        data, collator = (docs, DataCollatorWithFlattening()) if packed is True else (rows, default_data_collator)
        if packed in ("left", "right"):
            tokenizer = _tokenizer()
            tokenizer.padding_side = packed
            data, collator = texts, DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = cls(model=_model(kind), args=args, train_dataset=data, data_collator=collator)
        trainer.train()
        out[kind, packed, layout] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return out


@pytest.mark.skipif(not SLOW, reason="slow tier (CP_DTENSOR_SLOW=1): four Trainer runs a family, ~25 s")
def test_dsa_trainer_cp2():
    """with_context_parallel(Trainer) at CP=2 logs the unchanged Trainer's losses within 1e-4 (both families, rows
    and packed documents; DeepSeek-V3.2's packed documents also under layout="documents")."""
    want = run_ranks(1, _trainer_ranks, False, timeout=600)[0]
    got = run_ranks(2, _trainer_ranks, True, timeout=600)
    for key in want:
        assert len(want[key]) == 3
        for r in got:
            assert max(abs(a - b) for a, b in zip(r[key], want[key])) <= 1e-4, (key, r[key], want[key])


@pytest.mark.parametrize("case", ["causal", "padded", "packed"])
def test_seen_keys_are_the_keys_a_rank_can_see(case):
    """The index keys sent to a rank: those one of its queries sees in CP=1's mask (brute force over every query),
    in every layout (the documents layout's plan too) at P = 2 and 3; with packed documents fewer than every other
    rank's."""
    from cp_dtensor.core.plan.documents import document_layout
    from cp_dtensor.core.plan.layout import global_order

    _, positions, _ = _batch()
    mask = torch.ones(B, N, dtype=torch.long)
    if case == "padded":
        mask[0, :5] = 0
        mask[1, -3:] = 0
    if case == "packed":
        positions = torch.stack([torch.cat([torch.arange(10), torch.arange(N - 10)]),
                                 torch.cat([torch.arange(7), torch.arange(9), torch.arange(N - 16)])])
    allowed = torch.ones(N, N, dtype=torch.bool).tril()[None].expand(B, -1, -1) if case == "causal" else \
        _allowed(positions, mask, case)  # [B, N, N]
    docs = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    rows = None if case == "causal" else ("real", mask.bool()) if case == "padded" else ("documents", docs * 7 + 3)
    for world in (2, 3):
        for layout in LAYOUTS:
            order = global_order(layout, world, N)
            got = sparse.seen_keys(order, world, B, rows)
            want = torch.stack([allowed[:, order.view(world, -1)[r]].any(1) for r in range(world)])  # [P, B, N]
            assert torch.equal(got, want), (case, world, layout)
            held = torch.zeros(world, N, dtype=torch.bool)
            held[torch.arange(world)[:, None], order.view(world, -1)] = True
            sent = int((got & ~held[:, None, :]).sum())  # keys that travel; the all-gather sends (P - 1) B N
            assert sent < (world - 1) * B * N if case != "causal" or layout == "contiguous" else sent <= (world - 1) * B * N
        lay = document_layout(docs, world)  # layout="documents": each row its own order
        got = sparse.seen_keys(lay.order, world, B, rows)
        want = torch.stack([torch.stack([allowed[b, lay.order[b].view(world, -1)[r]].any(0) for b in range(B)])
                            for r in range(world)])  # [P, B, N]
        assert torch.equal(got, want), (case, world, "documents")


def test_mla_path_names_the_ring_fallback(caplog):
    """The latent path is opt-in: kv_exchange="latent" takes it for a proven MLA family on sdpa / eager; the door
    says why not otherwise (the default ring, another kernel, comm_dtype, a family not proven), and
    kv_exchange="latent" there is refused with the families served."""
    import logging

    model, _ = build("deepseek_v3", MLA["deepseek_v3"])
    latent_ = partial(latent.mla_path, kv_exchange="latent")
    assert latent_(model, {"": "sdpa"}) == latent_(model, {"": "eager"}) == "latent"
    assert "kv_exchange='ring'" in latent.mla_path(model, {"": "sdpa"})  # the default
    assert "kv_exchange='allgather'" in latent.mla_path(model, {"": "sdpa"}, kv_exchange="allgather")
    assert latent.ring_exchange("latent") == "ring" and latent.ring_exchange("allgather") == "allgather"
    assert "flash_attention_2" in latent_(model, {"": "flash_attention_2"})
    assert "comm_dtype" in latent.latent_error(model, {"": "sdpa"}, comm_dtype=torch.bfloat16)
    assert latent.latent_error(model, {"": "sdpa"}) is None
    with caplog.at_level(logging.INFO, logger="cp_dtensor.hf.latent"):
        latent.report(model, latent.mla_path(model, {"": "sdpa"}))
    assert "runs the ring on the expanded K/V" in caplog.text
    model.config.model_type = "an_mla_family"
    assert "model_type='an_mla_family'" in latent_(model, {"": "sdpa"})
    assert "Use kv_exchange='ring'" in latent.latent_error(model, {"": "sdpa"})
    assert latent_(_model("deepseek_v32"), {"": "sdpa"}) is None  # DSA layers: hf/sparse.py's own path
    assert "no dense multi-head latent" in latent.latent_error(_model("deepseek_v32"), {"": "sdpa"})
    from transformers import Trainer

    from cp_dtensor.hf import with_context_parallel

    with pytest.raises(ValueError, match="one of 'ring', 'allgather', 'latent' at the transformers door.*got 'Latent'"):
        with_context_parallel(Trainer, cp_size=2, kv_exchange="Latent")  # the door's values named, not the ring's


def _mla_dynamic_ranks(rank, world, tmp):
    """dp = 2 x cp = 2: DeepSeek-V3's Trainer on skewed packed rows, layout="documents", on the latent path
    (static, and dynamic=True: each step planned over the 4 ranks; kv_exchange="latent") and on the ring (the
    default)."""
    import test_hf_trainer as trainer_tests

    def model(name):
        m, _ = build("deepseek_v3", MLA["deepseek_v3"])
        m.config.use_cache = False
        return m

    trainer_tests._env(rank, world)
    trainer_tests._model = model  # this rank process only
    out = {}
    for name, dynamic, exchange in (("latent", False, "latent"), ("latent dynamic", True, "latent"),
                                    ("ring", False, "ring")):
        run = trainer_tests._skewed_run(tmp, 2, dynamic, kv_exchange=exchange)
        out[name] = run["losses"] + run["grad_norm"]
    return out


@pytest.mark.skipif(not SLOW, reason="slow tier (CP_DTENSOR_SLOW=1): 4 ranks, three Trainer runs, ~8 s")
def test_mla_trainer_dynamic_dp2_cp2():
    """The latent path under the Trainer's layout="documents", static and dynamic=True (the plan over the dp x cp
    grid, the latent rows exchanged over the flattened mesh): the losses and grad norms the ring logs, within 1e-6."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(4, _mla_dynamic_ranks, tmp, timeout=600)
    for r in got:
        assert len(r["ring"]) == 6
        for name in ("latent", "latent dynamic"):
            assert max(abs(a - b) / abs(b) for a, b in zip(r[name], r["ring"])) <= 1e-6, (name, r)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_rows_shorter_than_index_topk(impl):
    """Note [DSA rows of CP=1's length]: rows of several lengths on one rank, one shorter than index_topk (a dynamic
    Trainer's replica of few tokens beside a longer one): each query's picks are those of the family's indexer on
    its own row alone (CP=1: fewer than index_topk where the row is shorter), the rest of its picks point at columns
    it cannot see (masked, never sent); the mask bool (sdpa) or additive (eager). Was a shape error in the ranks
    holding both."""
    from cp_dtensor.hf.sparse_rows import by_rows

    model = _model("deepseek_v32")
    layer = sparse.dsa_layers(model)[0]
    seg, lens = 12, [5, 12, 3]  # three rows end to end (a plan's row_len 12): 5 tokens then CP's padding, 12, 3
    n = seg * len(lens)
    torch.manual_seed(3)
    hidden = torch.randn(1, n, model.config.hidden_size)
    col = torch.arange(n)
    pos = (col % seg)[None]
    cos, sin = model.model.rotary_emb(hidden, pos)
    q_resid = layer.q_a_layernorm(layer.q_a_proj(hidden))
    real = (col % seg) < torch.tensor(lens)[col // seg]
    allowed = ((col[None, :] <= col[:, None]) & (col[None, :] // seg == col[:, None] // seg) & real[None, :])[None]

    scored = allowed if impl == "sdpa" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)

    class Keys:  # one rank: the keys are already in global order
        def update_indexer(self, k, layer_idx):
            return k

    with torch.no_grad():
        got = by_rows(layer.indexer, seg, torch.tensor(lens), col[None], hidden, q_resid, (cos, sin), scored, pos,
                      Keys()).long()
        assert got.shape == (1, n, K)
        for r, length in enumerate(lens):
            sl = slice(r * seg, r * seg + length)
            want = layer.indexer(hidden[:, sl], q_resid[:, sl], (cos[:, sl], sin[:, sl]),
                                 torch.ones(length, length, dtype=torch.bool).tril()[None], pos[:, sl]).long()
            assert torch.equal(got[:, sl, :want.shape[-1]], want + r * seg), (r, length)
            assert not allowed[:, sl].gather(-1, got[:, sl, want.shape[-1]:]).any(), (r, length)
