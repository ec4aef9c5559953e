"""``[cp_dtensor] sequence_tiling``: torchtitan's LM head + cross-entropy and its MLPs in sequence tiles.

Note [Sequence tiling in torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's step is ``pred = model(inputs)`` (the head's logits [B, S_local, V]) and then ``loss_fn(pred,
labels)`` (a sum of cross-entropy over the rank's tokens; the trainer divides by the global count of
labelled tokens). With ``sequence_tiling`` the two become one tiled computation (Note [Sequence tiling]
in core/tiling.py), so no [S_local, V] tensor exists in forward or in backward:

* the head (``model.output``, an ``nn.Linear``) passes its input through, the hidden states [B, S_local,
  D], tagged with (hidden, weight, bias) *as its forward saw them* (under FSDP the unsharded
  parameters: the final norm + head group keeps them until the backward under torchtitan's default
  ``fsdp_reshard_after_forward``; "always" would free them, and is refused);
* under tensor parallelism the head is vocabulary-parallel: torchtitan's plan makes it ``ColwiseParallel
  (input_layouts=Shard(1))`` (its weight a DTensor ``Shard(0)`` over the vocabulary), whose input hook
  hands the forward the hidden states replicated over TP (all-gathered along the sequence). The tag keeps
  those; ``linear_cross_entropy`` combines each tile's log-sum-exp over the TP group (Note [Sequence
  tiling]) and leaves dh ``Partial``, so the input hook's redistribute reduce-scatters it back to the
  sequence shards. TP's output hook replaces the forward's output (``Shard(-1)`` under loss parallel, a
  chunk of the replicated hidden states, no communication; or ``Replicate``), dropping its attribute, so
  ``tag_after_tp`` adds a forward hook after TP's that puts the tag (stashed on the head by the forward)
  on the final output. A TP head that is not sharded over the vocabulary raises there, on every rank,
  before the loss's first collective. torchtitan 0.3 does not redistribute a TP module's output but checks
  that it is placed as its plan says (``Shard(-1)`` under loss parallel): there the head's forward hands on
  its replicated hidden states as ``Shard(-1)`` chunks itself (``vocab_sharded_output``), and the same
  hook tags the result;
* the train spec's loss becomes ``linear_cross_entropy(hidden, weight, labels, num_items_in_batch=1)``:
  the same sum, ignore index -100, labels already shifted by torchtitan's data; dW accumulates into the
  unsharded weight's gradient, which FSDP reduce-scatters as before. A prediction without the tag (a
  model whose head did not run through the plugin) raises instead of being taken for logits;
* every block's dense ``feed_forward`` (SwiGLU) runs ``tile`` tokens at a time under non-reentrant
  checkpointing (``tiled_forward``), so its [tile, hidden_dim] intermediates exist for one tile at a time.
  MoE layers (``moe``: torchtitan's ``MoE``, token-wise: each token's top-k experts, no capacity) run in
  tiles too, in eager jobs: their router adds each call's tokens per expert to the ``tokens_per_expert``
  buffer (the load-balancing statistics) in forward, which a tile's recomputation in backward would add
  again; the recomputation runs with that buffer swapped for a scratch one (``tiled_forward``'s
  ``recompute_context``), so the statistics equal the untiled layer's. Compiled jobs keep MoE layers whole
  (the compiler replays a checkpointed region from its graph, not through Python). Under TP the MLPs are left whole too: sequence parallelism
  reduce-scatters each MLP call's output along the sequence (``w2``'s ``RowwiseParallel(output_layouts=
  Shard(1))``), so a tile's output would be a [T / TP] slice of the tile, not of the sequence; TP already
  divides the MLP's intermediate by the TP degree.

The loss equals the untiled one (fp32: to rounding; tests/titan/v02/test_titan_tiling.py). It applies at
every CP degree, CP = 1 included (the plugin's parallelize runs for every job of a served family).

Note [Tiled blocks under compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan compiles each block on its own (``fullgraph=True``), all of them one code object, so Dynamo keeps
one cache entry a guard set and refuses the ninth (``recompile_limit`` 8: ``FailOnRecompileLimitHit``).
A tiled MLP must therefore look the same to every block's guards. A per-module ``forward`` (an instance
attribute, e.g. a ``functools.partial``) does not: Dynamo guards on its identity, so each block compiled a
graph of its own -- 6 graphs for a 6-layer model, twice that once validation runs under ``no_grad``, and
more than 8 layers failed at the first step. So a tiled module's class is swapped instead, to
``Tiled<Class>`` (made once per class: ``_Tiled`` before the module's own class, FSDP2's way of wrapping)
whose ``forward`` tiles the class's own, the tile size an int attribute equal on every block: every block
passes one guard set, so the blocks share one graph (and one more under ``no_grad``). State dict keys and
the module tree are unchanged.

Note [float8 and the tiled LM head]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's float8 (and MX) linear converters swap every ``nn.Linear`` their filter admits for torchao's
``Float8Linear``, the LM head included unless ``filter_fqns`` names it (torchtitan's MX default does, its
float8 default does not). The tiled head never runs its module's forward: ``linear_cross_entropy`` reads
the weight and multiplies each tile itself, in the parameters' precision. Left alone, a float8 job with
``sequence_tiling`` would convert the head and then compute it in fp32, silently unlike the untiled job
(llama3 debug, rowwise, step 1: 8.17699 against 8.17344). So the plugin says so at start: before the
converters are built, the head's name joins each float8 / MX converter's ``filter_fqns`` (a warning
names it), and the job is then exactly the untiled job with ``filter_fqns = ["output"]`` -- torchtitan's
own recommendation for float8 on the head, whose logits feed a softmax over the whole vocabulary.
Quantizing the tiles instead would not give the untiled numbers either: rowwise float8's weight
gradient scales each vocabulary row over all the tokens, which a tile does not see.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ...core.tiling import linear_cross_entropy, tiled_forward

__all__ = ["apply_sequence_tiling", "tag_after_tp", "tiled_loss", "HEAD_TAG"]

HEAD_TAG = "_cp_dtensor_head"  # the attribute of the head's output: (hidden, weight, bias) as its forward saw them


def _head_forward(head: nn.Linear, hidden: torch.Tensor, *, vocab_sharded_output: bool = False) -> torch.Tensor:
    # See Note [Sequence tiling in torchtitan]: the hidden states [B, S_local, D], tagged with the head
    out = hidden.view_as(hidden)  # a new tensor object: the tag never lands on a tensor another module holds
    if vocab_sharded_output and isinstance(out, DTensor):  # torchtitan 0.3 checks a TP head's output placement
        out = out.redistribute(out.device_mesh, [Shard(-1)])  # a chunk of the replicated states: no communication
    tag = (hidden, head.weight, head.bias)
    setattr(out, HEAD_TAG, tag)
    if isinstance(head.weight, DTensor):  # TP's output hook replaces ``out``: _retag puts the tag on its result
        setattr(head, HEAD_TAG, tag)
    return out


def _retag(head: nn.Module, args, output):
    tag = head.__dict__.pop(HEAD_TAG, None)
    if tag is None:
        return output
    weight = tag[1]
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"[cp_dtensor] sequence_tiling under tensor parallelism serves a vocabulary-parallel LM head "
                         f"(its weight placed (Shard(0),) on the TP mesh: torchtitan's ColwiseParallel plan); this "
                         f"head's weight is placed {tuple(weight.placements)}. Use the family's own TP plan, or "
                         "remove sequence_tiling.")
    setattr(output, HEAD_TAG, tag)
    return output


def tag_after_tp(model: nn.Module, *, head_name: str = "output") -> None:
    """After TP's plan: re-tag the tiled head's output past TP's output hook (Note [Sequence tiling in
    torchtitan]). Hooks run in the order registered, so this one runs after TP's (and FSDP's)."""
    getattr(model, head_name).register_forward_hook(_retag)


def _contiguous(forward, x: torch.Tensor):
    return forward(x.contiguous())  # x: a [B, T, D] tile of [B, S, D]; torchtitan's MoE views it as [B * T, D]


@contextlib.contextmanager
def _uncounted(moe: nn.Module):
    # a tile's recomputation counts its tokens into a scratch buffer: Note [Sequence tiling in torchtitan]
    counts = moe.tokens_per_expert
    moe.tokens_per_expert = torch.zeros_like(counts)
    try:
        yield
    finally:
        moe.tokens_per_expert = counts


def apply_sequence_tiling(model: nn.Module, tile: int, *, head_name: str = "output", tile_mlps: bool = True,
                          tile_moe: bool = False, stage: bool = False, vocab_sharded_output: bool = False
                          ) -> tuple[int, int]:
    """Tile ``model``'s head + loss, (``tile_mlps``) its blocks' dense MLPs and (``tile_moe`` too) their MoE
    layers (Note [Sequence tiling in torchtitan]). Refuses, by name, a head that is not an ``nn.Linear``;
    ``stage``: ``model`` is a pipeline stage, whose head is None unless it is the last.
    Returns (tiled MLPs and MoE layers, those left whole)."""
    head = getattr(model, head_name, None)
    if stage and head is None:
        pass  # a pipeline stage before the last: its blocks only
    elif not isinstance(head, nn.Linear):
        raise ValueError(f"[cp_dtensor] sequence_tiling tiles the LM head with the loss; {type(model).__name__}."
                         f"{head_name} is {type(head).__name__}, not an nn.Linear. Remove sequence_tiling for this model.")
    elif type(head).forward is not nn.Linear.forward:  # torchao's Float8Linear: Note [float8 and the tiled LM head]
        raise ValueError(f"[cp_dtensor] sequence_tiling computes the LM head {head_name!r} itself, in its parameters' "
                         f"precision; this head was converted to {type(head).__name__}, whose own matmul the tiles would "
                         f"drop. Add {head_name!r} to the converter's filter_fqns (e.g. --quantize.linear.float8."
                         f"filter_fqns {head_name}), or remove sequence_tiling.")
    else:
        head.forward = functools.partial(_head_forward, head, vocab_sharded_output=vocab_sharded_output)
    tiled = moe = 0
    for block in getattr(model, "layers", {}).values():
        ffn = getattr(block, "feed_forward", None)
        if getattr(block, "moe_enabled", False):
            layer = getattr(block, "moe", None)
            if not (tile_mlps and tile_moe) or layer is None:
                moe += 1
                continue
            _tile_module(layer, tile, moe=True)
            tiled += 1
            continue
        if ffn is None or not tile_mlps:
            moe += 1
            continue
        _tile_module(ffn, tile, moe=False)
        tiled += 1
    return tiled, moe


class _Tiled:
    """Put before a module's class (``_tile_module``): the class's own ``forward`` in tiles of
    ``_cp_dtensor_tile`` tokens. See Note [Tiled blocks under compile]."""

    _cp_dtensor_tile: int
    _cp_dtensor_moe: bool  # torchtitan's MoE: each tile contiguous, its token counts kept out of recomputation
    _cp_dtensor_what: str  # the module's own class name, for errors (a class attribute)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        forward, context = super().forward, None
        if self._cp_dtensor_moe:
            forward = functools.partial(_contiguous, forward)
            if isinstance(getattr(self, "tokens_per_expert", None), torch.Tensor):
                context = functools.partial(_uncounted, self)
        return tiled_forward(forward, x, *args, tile_size=self._cp_dtensor_tile, what=self._cp_dtensor_what,
                             recompute_context=context, **kwargs)


_TILED_CLASSES: dict[type, type] = {}


def _tile_module(module: nn.Module, tile: int, *, moe: bool) -> None:
    # Note [Tiled blocks under compile]: a class swap, one class for every block's module, not a per-module forward
    cls = type(module)
    if not issubclass(cls, _Tiled):
        if cls not in _TILED_CLASSES:
            _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (_Tiled, cls),
                                       {"__module__": cls.__module__, "_cp_dtensor_what": cls.__name__})
        module.__class__ = _TILED_CLASSES[cls]
    module._cp_dtensor_tile, module._cp_dtensor_moe = tile, moe


def tiled_loss(loss_fn, tile: int):
    """``loss_fn(pred, labels)`` as the tiled head + cross-entropy sum (Note [Sequence tiling in torchtitan])."""

    @functools.wraps(loss_fn)
    def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = getattr(pred, HEAD_TAG, None)
        if head is None:
            raise ValueError("[cp_dtensor] sequence_tiling: the model's output did not come through the plugin's "
                             "tiled LM head (its loss would take hidden states for logits). Train a family the "
                             "plugin serves, or remove sequence_tiling.")
        hidden, weight, bias = head
        return linear_cross_entropy(hidden, weight, labels, bias=bias, tile_size=tile, num_items_in_batch=1)

    return loss
