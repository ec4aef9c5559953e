"""torchtitan 0.3's qwen3_5 (Gated DeltaNet layers beside full-attention layers) under cp_dtensor's CP.

Note [qwen3_5 under the 0.3 plugin]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
qwen3_5's blocks (``Qwen35TransformerBlock``) hold ``attn``: a ``Qwen35Attention`` on every fourth layer
(gated q, partial rotary, an inner attention torchtitan calls as llama3's does) or a ``GatedDeltaNet``.
Under the plugin (``apply_hybrid``, from ``apply_ring_attention``):

* a full-attention layer's ``inner_attention`` becomes ``RingInnerAttention`` (Note [0.3 inner attention
  as the ring]); its rotary positions are the data's, sharded with the batch (text batches rotate by the
  2-D ``positions``; multimodal batches' ``mrope_positions`` are not sharded, so the plugin takes text
  data only: ``check_hybrid`` refuses torchtitan's ``MMDataLoader`` at start);
* a Gated DeltaNet layer's two token-mixing steps run on this rank's shard through
  ``cp_dtensor.linear_attention`` (Note [Linear attention under CP]): its ``kernel`` module becomes
  ``ShardedGatedDeltaKernel`` (``sharded_delta_rule``) and its ``_causal_conv`` the bound
  ``_sharded_causal_conv`` (``sharded_causal_conv1d``, silu), both over the CP group (or this rank alone
  at CP = 1) in the batch's layout. That op takes contiguous runs only, so qwen3_5 runs in the headtail
  layout (its configs' default here) or contiguous; striped is refused at start.

The layer folds [B, L] into one row (1, B * L) before both steps and passes the document offsets it
reads from its mask (``cu_seq_q``). The plugin's mask for those layers is ``LinearDocs``: the ring's
``RingDocs`` whose ``cu_seq_q`` is the [B, S_local] document-id tensor itself, sharded by ``shard_cp_batch``
like every ``RingDocs``; the replacements read B and the ids from it, unfold the row, and restart the
state and the conv at each document, as fla's varlen kernels do with torchtitan's offsets.

The chunk kernel: fla's ``chunk_gated_delta_rule`` (torchtitan's own) on an accelerator;
transformers' ``torch_chunk_gated_delta_rule`` on CPU, where fla's Triton kernels do not run -- unwrapped:
transformers 5.x wraps it to call fla's kernel whenever ``fla`` imports, and torchtitan's qwen3_5 needs
``fla`` installed (its model module imports it), so on CPU the wrapper would reach Triton.

torchtitan's ``parallelize_qwen3_5`` refuses any CP degree above 1 ("Context Parallel is not yet
supported for Qwen3.5"): ``without_cp`` hands it the parallel dims with ``cp_enabled`` False; the CP
ranks still shard the parameters (FSDP's mesh is data-parallel x CP). The model reads
``special_tokens["image_id"]`` even without images: text batches get ids that match no token
(``_text_only_special_tokens``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..._compat import TITAN03_QWEN35_CONV
from ...core.linear.linear_attention import check_linear_layout, sharded_causal_conv1d, sharded_delta_rule
from ..shared.options import CPDTensor
from .attention import RingDocs, RingInnerAttention, document_ids

__all__ = ["HYBRID", "LinearDocs", "ShardedGatedDeltaKernel", "apply_hybrid", "check_hybrid", "hybrid_masks",
           "is_hybrid", "qwen35_debugmodel_text", "without_cp"]

HYBRID = "qwen3_5"  # the torchtitan 0.3 family with linear-attention layers
_NO_TOKEN = -1  # a vision token id no text token has


def is_hybrid(model_config) -> bool:
    return type(model_config).__module__.startswith(f"torchtitan.models.{HYBRID}")


@dataclasses.dataclass(frozen=True)
class LinearDocs(RingDocs):
    """The Gated DeltaNet layers' mask: ``ids`` [B, S_local], handed to the layer as its ``cu_seq_q``
    (Note [qwen3_5 under the 0.3 plugin])."""

    @property
    def cu_seq_q(self) -> torch.Tensor:
        return self.ids

    @property
    def cu_seq_q_host(self) -> tuple[int, ...]:
        return ()  # the layer only turns it into a tensor; the replacements do not read it


def hybrid_masks(model_config, positions: torch.Tensor) -> dict[str, RingDocs]:
    """qwen3_5's ``get_attention_masks(positions)`` as ring rules, keyed as the blocks read them."""
    ids = document_ids(positions)
    return {"quadratic_attention": RingDocs(ids), "deltanet": LinearDocs(ids)}


def _chunk_kernel():
    if torch.accelerator.is_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # transformers wraps it to call fla's kernel whenever fla imports (Triton: no CPU); the torch function itself
    return inspect.unwrap(torch_chunk_gated_delta_rule)


def _ids(cu_seqlens: torch.Tensor | None, n: int) -> torch.Tensor:
    if cu_seqlens is None or cu_seqlens.dim() != 2 or cu_seqlens.numel() != n:
        raise TypeError("cp_dtensor's Gated DeltaNet layers need the plugin's LinearDocs mask (Note [qwen3_5 under "
                        "the 0.3 plugin]); got " + ("none" if cu_seqlens is None else f"{tuple(cu_seqlens.shape)}")
                        + ". Train through cp_dtensor's trainer (python -m cp_dtensor.titan.train).")
    return cu_seqlens


class ShardedGatedDeltaKernel(nn.Module):
    """Stands in for torchtitan's ``GatedDeltaKernel``: the gated delta rule (q, k l2-normalised in the
    kernel) over ``group`` on this rank's shard, documents from the ``LinearDocs`` ids."""

    def __init__(self, *, group: dist.ProcessGroup | DeviceMesh, layout: str):
        super().__init__()
        self.group, self.layout = group, check_linear_layout(layout)
        self.chunk = _chunk_kernel()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu=None) -> torch.Tensor:
        # q, k: [1, B * S_local, Hk, dk]; v: [1, B * S_local, Hv, dv]; g, beta: [1, B * S_local, Hv]
        ids = _ids(cu_seqlens, q.shape[1])
        b, s = ids.shape
        if q.shape[2] != v.shape[2]:  # grouped heads, as GatedDeltaKernel expands them
            q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
        q, k, v, g, beta = (x.reshape(b, s, *x.shape[2:]) for x in (q, k, v, g, beta))
        out = sharded_delta_rule(self.chunk, q, k, v, g, beta, mesh=self.group, layout=self.layout,
                                 document_ids=ids, use_qk_l2norm_in_kernel=True)
        return out.reshape(1, b * s, *out.shape[2:])  # [1, B * S_local, Hv, dv]

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, kernel={self.chunk.__module__}.{self.chunk.__name__}"


def _sharded_causal_conv(self, x: torch.Tensor, conv: nn.Module, cu_seqlens: torch.Tensor | None = None,
                         cu_seqlens_cpu=None, *, group, layout: str) -> torch.Tensor:
    # bound to each GatedDeltaNet as its _causal_conv; x: [1, B * S_local, C] -> silu(conv(x)), same shape
    ids = _ids(cu_seqlens, x.shape[1])
    b, s = ids.shape
    x_bcs = x.reshape(b, s, x.shape[-1]).transpose(1, 2)
    out = sharded_causal_conv1d(x_bcs, conv.weight.squeeze(1), conv.bias, "silu", mesh=group, layout=layout,
                                document_ids=ids)
    return out.transpose(1, 2).reshape(1, b * s, -1)


def apply_hybrid(model: nn.Module, group: dist.ProcessGroup | DeviceMesh, section: CPDTensor) -> list[RingInnerAttention]:
    """qwen3_5: full-attention layers -> the ring, Gated DeltaNet layers -> the sharded delta rule and conv
    (Note [qwen3_5 under the 0.3 plugin]). Returns the ring modules."""
    from torchtitan.models.qwen3_5.model import GatedDeltaNet, Qwen35Attention

    layout = check_linear_layout(section.layout)
    ring = []
    for i, block in model.layers.items():
        attn = block.attn
        if isinstance(attn, Qwen35Attention):
            attn.inner_attention = RingInnerAttention(group=group, layout=layout, comm_dtype=section.comm_torch_dtype,
                                                      kv_exchange=section.kv_exchange)
            ring.append(attn.inner_attention)
        elif isinstance(attn, GatedDeltaNet):
            attn.kernel = ShardedGatedDeltaKernel(group=group, layout=layout)
            conv = functools.partial(_sharded_causal_conv, group=group, layout=layout)
            setattr(attn, TITAN03_QWEN35_CONV, types.MethodType(conv, attn))
        else:
            raise ValueError(f"cp_dtensor: layer {i} of qwen3_5 holds a {type(attn).__name__}, neither Qwen35Attention "
                             "nor GatedDeltaNet; the plugin serves torchtitan 0.3.0's qwen3_5.")
    model.register_forward_pre_hook(_text_only_special_tokens, with_kwargs=True)
    return ring


def _text_only_special_tokens(module, args, kwargs):
    if kwargs.get("special_tokens") is None and kwargs.get("pixel_values") is None \
            and kwargs.get("pixel_values_videos") is None:
        kwargs["special_tokens"] = {"image_id": _NO_TOKEN, "video_id": _NO_TOKEN}
        return args, kwargs
    return None


class _WithoutCP:
    """``parallel_dims`` with ``cp_enabled`` False, everything else delegated (Note [qwen3_5 under the 0.3
    plugin])."""

    cp_enabled = False

    def __init__(self, dims):
        self._dims = dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


def without_cp(parallel_dims):
    return _WithoutCP(parallel_dims)


def check_hybrid(config) -> list[str]:
    """What the plugin cannot run of a qwen3_5 job (an empty list: all of it). No communication."""
    section: CPDTensor = config.cp_dtensor
    problems = []
    if section.layout not in ("headtail", "contiguous"):
        problems.append(f"qwen3_5 with --cp_dtensor.layout {section.layout} (its Gated DeltaNet layers pass their "
                        "state between contiguous runs of tokens: Note [Linear attention under CP]; use "
                        "--cp_dtensor.layout headtail, its default here, or contiguous)")
    if section.ulysses_degree > 1:
        problems.append("qwen3_5 with --cp_dtensor.ulysses_degree > 1 (the Gated DeltaNet layers run over the whole "
                        "CP group in the sequence layout)")
    if "MMDataLoader" in type(config.dataloader).__qualname__:
        problems.append("qwen3_5 with multimodal batches (MMDataLoader: their mrope_positions and vision scatter "
                        "are not sharded; use a text dataloader, e.g. --module cp_dtensor.titan --config "
                        "qwen35_debugmodel_text)")
    return problems


def qwen35_debugmodel_text():
    """torchtitan's qwen35_debugmodel on text: its model (vocabulary cut to 2048, as llama3's debug model; the
    vision encoder stays, unused), a text dataloader and tokenizer. torchtitan's own config needs torchvision
    for its multimodal dataloader."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    try:
        from torchtitan.models.qwen3_5 import model_registry
    except ImportError as e:
        raise ImportError(f"torchtitan's qwen3_5 imports fla ({e}): pip install flash-linear-attention (fla's "
                          "kernels need a GPU; on CPU the plugin runs transformers' torch kernel instead)") from e

    spec = model_registry("debugmodel")
    vocab = 2048
    m = spec.model
    model = dataclasses.replace(m, vocab_size=vocab,
                                tok_embeddings=dataclasses.replace(m.tok_embeddings, num_embeddings=vocab),
                                lm_head=dataclasses.replace(m.lm_head, out_features=vocab))
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        hf_assets_path="./tests/assets/tokenizer",
        model_spec=dataclasses.replace(spec, model=model),
        optimizer=default_adamw(lr=5e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=1, seq_len=512, steps=10),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


CONFIGS = {"qwen35_debugmodel_text": qwen35_debugmodel_text}  # the plugin's own configs (config_registry.py)
