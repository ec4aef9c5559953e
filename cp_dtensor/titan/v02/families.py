"""One ``apply_ring_attention`` for every torchtitan 0.2.2 model family, and the few fixes a family needs.

Note [One mechanism for every family]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every decoder family torchtitan 0.2.2 ships (llama3, qwen3, deepseek_v3, llama4, gpt_oss) has the
same shape where it matters: ``model.layers`` holds blocks, ``block.attention`` projects q, k, v,
applies RoPE and calls ``block.attention.inner_attention(q, k, v, ...)`` -- an SDPA or a flex
wrapper -- with ``block_mask=`` the model's mask on flex flavors. So CP needs only:

1. ``inner_attention`` -> ``RingAttention`` (attention.py) in every block. What differs per family
   is read from the modules, not from a per-model copy: MLA's v head size (the ring takes Dv != Dqk),
   llama4's per-layer ``use_rope`` (which entry of the mask dict it passes whole; see Note [Flex
   masks as ring masks]), gpt_oss's ``sinks`` parameter (Note [gpt_oss sinks]).
2. On flex flavors, ``model.get_attention_masks`` -> ``flex.ring_masks``: the same masks as ring rules.
   The ring then runs at CP = 1 too (the plugin takes over flex attention and logs it): torch 2.13's
   FlexAttention has no CPU backward, and CP = 1 and CP = P compute the same masks this way.
3. RoPE by global position: the batch carries ``positions`` (Note [CP batch and positions]). gpt_oss's
   forward takes none and slices its RoPE table ``[0:S]``; a forward pre-hook takes ``positions`` and
   gives the model, for that forward, the table's rows at those positions (``_rope_rows_by_position``);
   per-row positions [B, S_local] (the documents layout) give each row its own rows (``_per_row_rope``).

Note [gpt_oss sinks]
~~~~~~~~~~~~~~~~~~~~
gpt_oss asks its flex wrapper for (out, lse) and rescales ``out * sigmoid(lse - sinks)`` itself. Under
CP each rank's flex lse would cover only its keys; the ring instead puts the sinks into the merged
softmax (``ring_attention(sinks=...)``) and returns an lse of +inf, so the model's rescale is exactly
1 with zero gradient, and ``sinks.grad`` comes from the ring (each rank's share; FSDP over dp x cp sums it).

Fixes, each applied by ``apply_family_fixes`` and logged:

* qwen3 ties ``output.weight`` to ``tok_embeddings.weight``; torchtitan's FSDP puts the two in
  different groups, which fails as soon as FSDP spans more than one rank (CP makes it span the CP
  ranks): ``Parameter 'tok_embeddings.weight' is shared with a parameter already managed by another
  FSDP group``. The plugin shards embedding, final norm and output as one FSDP group first.
* qwen3 under TP: torchtitan's TP plan distributes ``tok_embeddings.weight`` (RowwiseParallel) and
  ``output.weight`` (ColwiseParallel) one after the other, each into a new parameter, which unties
  them: the model then trains two matrices where it has one (CP x TP step 1 matched CP = 1, step 2
  was off by 3e-4). Both are Shard(0) (vocab rows) on the TP mesh, so the plugin ties ``output`` back
  to the embedding's DTensor after TP (``tied_embedding_tp``).
* gpt_oss's routers have a gate bias that torchtitan never initialises (``init_weights`` sets only the
  gate's weight), so a seed checkpoint holds whatever memory ``to_empty`` left: NaN here. The plugin
  initialises router gate biases to zero after the model's ``init_weights``.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.tools.logging import logger

from ..shared.heads import ulysses_mesh
from .attention import RingAttention
from .config import CPDTensor
from .flex import ring_masks

__all__ = ["apply_ring_attention", "apply_family_fixes", "attention_modules", "tied_embedding_fsdp", "tied_embedding_tp"]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each block's attention module (the one that owns ``inner_attention``), or a clear error."""
    layers = getattr(model, "layers", None)
    found = [getattr(block, "attention", None) for block in (layers.values() if layers is not None else [])]
    if not found or not all(hasattr(a, "inner_attention") for a in found):
        raise ValueError(
            f"cp_dtensor found no blocks with attention.inner_attention in {type(model).__name__}; it serves "
            "torchtitan decoders whose blocks call an inner attention module (llama3, qwen3, deepseek_v3, "
            "llama4, gpt_oss). Set context_parallel_degree = 1 for this model."
        )
    return found


def _single_rank_group() -> dist.ProcessGroup:
    # CP = 1 with the ring (flex flavors): a group of this rank alone (every rank creates every group)
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    group, _ = dist.new_subgroups(group_size=1)
    return group


def apply_ring_attention(model: nn.Module, cp_mesh, cfg: CPDTensor) -> nn.Module:
    """Route every attention call of a torchtitan model through cp_dtensor's ring over ``cp_mesh``
    (None: CP = 1, the ring on this rank alone), in ``cfg.layout`` with ``cfg.comm_dtype`` on the wire.
    See Note [One mechanism for every family]. Returns ``model``, changed in place."""
    attn_type = getattr(model.model_args, "attn_type", "sdpa")
    if attn_type not in ("sdpa", "flex"):
        raise ValueError(
            f'cp_dtensor supports attn_type "sdpa" and "flex"; this model flavor uses "{attn_type}". Pick an SDPA '
            'or flex flavor (e.g. "debugmodel", "debugmodel_flex_attn") or set context_parallel_degree = 1.'
        )
    if cp_mesh is None:
        group = _single_rank_group()
    elif cfg.ulysses_degree > 1:  # (U, R) mesh, U fast-varying in the CP group: Note [Ulysses in torchtitan]
        group = ulysses_mesh(cp_mesh, cfg.ulysses_degree)
    else:
        group = cp_mesh.get_group()
    # CP = 1: every layout is the identity on one rank; "documents" plans only sharded batches (no plan at CP = 1)
    layout = "striped" if cp_mesh is None and cfg.layout == "documents" else cfg.layout
    for attn in attention_modules(model):
        mask_key = None
        if attn_type == "flex" and hasattr(attn, "use_rope"):  # llama4 passes its whole {"rope", "nope"} dict
            mask_key = "rope" if attn.use_rope else "nope"
        attn.inner_attention = RingAttention(
            group=group, layout=layout, comm_dtype=cfg.comm_torch_dtype, mask_key=mask_key,
            kv_exchange=cfg.kv_exchange,
            sinks_of=attn if isinstance(getattr(attn, "sinks", None), nn.Parameter) else None,
        )
    if attn_type == "flex":
        model.get_attention_masks = functools.partial(ring_masks, model)  # see Note [Flex masks as ring masks]
        if cp_mesh is None:
            logger.info("cp_dtensor: flex attention runs through the ring on this rank alone (CP = 1); "
                        "see Note [One mechanism for every family]")
    if "positions" not in inspect.signature(model.forward).parameters:
        _rope_rows_by_position(model)
    return model


def _rope_rows_by_position(model: nn.Module) -> None:
    """gpt_oss: take ``positions`` [1, S_local] from the forward call and hand the model the rows of its
    RoPE table at those positions for that forward (it slices the table [0:S_local]). See Note [One
    mechanism for every family], 3."""
    name = next((n for n in ("rope_cache", "freqs_cis") if isinstance(getattr(model, n, None), torch.Tensor)), None)
    if name is None:
        raise ValueError(f"{type(model).__name__}.forward takes no positions and has no rope_cache / freqs_cis "
                         "table: cp_dtensor cannot rotate its tokens by global position. Set context_parallel_degree = 1.")
    saved: list = []

    def take(module, args, kwargs):
        positions = kwargs.pop("positions", None)
        if positions is not None:
            table = getattr(module, name)
            swap = None
            if positions.shape[0] != 1:  # the documents layout: rows hold different positions
                swap = _per_row_rope(module, positions.shape)
            saved.append((table, swap))
            setattr(module, name, table[positions[0]] if swap is None else table[positions])  # [(B,) S_local, ...]
        return args, kwargs

    def restore(module, args, output):
        if saved:
            table, swap = saved.pop()
            setattr(module, name, table)
            if swap is not None:
                swap()

    model.register_forward_pre_hook(take, with_kwargs=True)
    model.register_forward_hook(restore, always_call=True)


def _per_row_rope(model: nn.Module, shape) -> callable:
    """gpt_oss's ``reshape_for_broadcast`` takes one table row per position ([S, 2 Dh]); under the documents
    layout every row of the batch holds other positions, so for the forward its module's function takes a
    table [B, S, 2 Dh] as [B, S, 1, 2 Dh] (broadcast over heads). Returns the undo."""
    import sys

    module = sys.modules[type(model).__module__]
    original = getattr(module, "reshape_for_broadcast", None)
    if original is None:
        raise ValueError(f"{type(model).__name__}: per-row positions {list(shape)} (the documents layout) need its "
                         "module's reshape_for_broadcast, which it has not. Use a named layout or local_batch_size = 1.")

    @functools.wraps(original)
    def per_row(rope_cache, x):
        if rope_cache.dim() == 3:  # [B, S, 2 Dh]: row b's table at its positions
            return rope_cache.view(rope_cache.shape[0], rope_cache.shape[1], 1, rope_cache.shape[2])
        return original(rope_cache, x)

    module.reshape_for_broadcast = per_row

    def undo() -> None:
        module.reshape_for_broadcast = original

    return undo


def apply_family_fixes(model: nn.Module) -> None:
    """Fixes independent of CP that some families need to train at all (Note [One mechanism for every family])."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    routers = [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter) and m.gate.bias is not None]
    if routers:
        init = model.init_weights

        @functools.wraps(init)
        def init_weights(*args, **kwargs):
            out = init(*args, **kwargs)
            for router in routers:
                nn.init.zeros_(router.gate.bias)
            logger.info(f"cp_dtensor: initialised {len(routers)} MoE router gate biases to zero "
                        "(torchtitan 0.2.2 leaves them uninitialised)")
            return out

        model.init_weights = init_weights


def tied_embedding_tp(apply_tp):
    """torchtitan's non-MoE TP step with ``output.weight`` tied back to the distributed embedding weight
    (qwen3; see the fixes in Note [One mechanism for every family])."""

    @functools.wraps(apply_tp)
    def wrapped(model, *args, **kwargs):
        out = apply_tp(model, *args, **kwargs)
        emb, head = model.tok_embeddings.weight, model.output.weight
        if head is not emb:
            assert emb.shape == head.shape and emb.placements == head.placements, "tied weights placed apart"
            model.output.weight = emb
            logger.info("cp_dtensor: output weight tied back to the embedding after tensor parallelism")
        return out

    return wrapped


def tied_embedding_fsdp(apply_fsdp):
    """torchtitan's ``apply_fsdp`` with embedding, final norm and output sharded as one FSDP group first,
    for models that tie output to embedding (qwen3); see the fixes in Note [One mechanism for every family]."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

    @functools.wraps(apply_fsdp)
    def wrapped(model, dp_mesh, param_dtype, reduce_dtype, *args, **kwargs):
        ends = [model.tok_embeddings, model.norm, model.output]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        fully_shard(ends, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
        model.tok_embeddings = model.norm = model.output = None  # torchtitan's apply_fsdp skips what is None
        try:
            return apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype, *args, **kwargs)
        finally:
            model.tok_embeddings, model.norm, model.output = ends
            disable_fsdp_gradient_division(model)  # torchtitan divides the loss itself; covers the new group too
            logger.info("cp_dtensor: tied embedding, norm and output sharded as one FSDP group")

    return wrapped
