"""The transformers Trainer (and its subclasses: TRL's SFTTrainer, ...) under context parallelism, one line.

    Trainer = cp_dtensor.hf.with_context_parallel(transformers.Trainer, cp_size=2)   # was: transformers.Trainer

transformers, accelerate (and TRL for its trainers) are optional extras; only this module imports them.

Note [The Trainer under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``with_context_parallel(trainer_cls, cp_size=P)`` returns a subclass of ``trainer_cls`` whose
overrides of the Trainer's documented hooks do four things; nothing of the Trainer's own code is
copied, so TRL's and other subclasses keep their behaviour.

1. The data. The world is a (dp, cp) mesh, cp the inner dim (rank = dp_index * P + cp_index). The
   CP ranks of one data-parallel replica must see the same batches, so the dataloaders are prepared
   while accelerate's device mesh names a ``"cp"`` dim (``_compat.replica_dataloaders``): accelerate's
   ``prepare_data_loader`` then shards the samples over the dp replicas only, as it does for its own
   CP and TP ranks (map-style datasets, ``datasets`` iterable datasets, ``IterableDatasetShard``). The
   collator is wrapped (:class:`ShardingCollator`, collator.py): it runs the user's collator on the replica's
   examples, shifts the labels on the *full* row (``shift_labels``: a token's label may live on
   another rank), pads the row to the layout's multiple (pad labels -100: the padding is causal
   future, so no real token sees it), and hands the Trainer this rank's shard of every [B, N] tensor
   (input_ids, position_ids -- the global positions, arange when the collator gives none -- the 2-D
   padding mask, labels, shift_labels). Flash-attention varlen keys (``cu_seq_lens_*``,
   ``max_length_*``, ``seq_idx``: TRL's padding-free collator) are dropped: the documents come from
   the position ids (Note [transformers under CP] in hf/attention.py). Under ``layout="documents"`` the
   collator plans the full batch and shards with the plan, which rides in the batch to the model call
   (Note [One plan per batch in transformers] in hf/documents.py). A fingerprint of the full batch rides
   along, and the first hook of each step compares it across the CP group: CP ranks that were handed
   different batches (a rank-aware sampler, a collator drawing random numbers) raise on every rank.
2. The model: ``cp_dtensor.hf.apply_context_parallel`` (``documents="position_ids"`` by default, so packed rows
   are kept apart as flash-attention keeps them, whatever ``use_cache`` says).
3. The loss (Note [compute_loss under CP]). The Trainer counts ``num_items_in_batch`` over its batches'
   ``shift_labels`` -- here each rank's shard, so the count gathered over the world is every replica's label
   count once, CP=1's count. ``compute_loss`` runs the trainer class's own (the Trainer's, TRL's, a subclass's)
   as if each replica were one process, then multiplies the loss by P: the CP ranks' losses sum to the
   replica's, and DDP's average over the world's P x dp ranks is CP=1's average over its dp ranks. So the
   gradient, grad_norm and the logged loss (the mean over ranks) are CP=1's, whatever the loss code. The
   token counts (``num_input_tokens_seen``, ``total_flos``, TRL's ``num_tokens``) leave the layout's padding out:
   CP=1's counts.
4. Evaluation. ``prediction_step`` sums the CP ranks' losses into the replica's (what the Trainer
   computes on dp ranks without CP) and unshards logits and labels into the full rows; the gather
   the evaluation loop calls keeps each replica's rows once (the ranks with cp_index 0), then drops
   accelerate's even-batches padding as ``gather_for_metrics`` does. So ``evaluate()`` = CP=1. The
   logits at right-padding positions (attention_mask 0) are not CP=1's: there a pad token's attention
   output is zero (Note [Pad queries] in hf/attention.py), at CP=1 it sees the row's tokens; they carry no
   label. At a left pad (scored against the row's first token) both are zero.

Gradient reduction needs nothing: DDP and FSDP2 already reduce over every rank, CP ranks included
(FSDP2 over ``ParallelismConfig(dp_shard_size=world)`` is torchtitan's dp_shard_cp). A training step whose model
has neither raises on every rank (accelerate trains an unwrapped model after an ``evaluate()`` or ``predict()``
that ran before ``train()``: each CP rank would step on its own tokens' gradient). Checkpoints
hold the full model (DDP) and the optimizer as the Trainer saves them: nothing in them depends on P,
so a run resumes at another CP size (same dp, same batches).

``dynamic=True`` (with ``layout="documents"``) changes 1-3: the collator hands the replica's full rows and the
step's global batch is planned over every rank of the flattened (dp, cp) mesh, the ring's and the loss count's;
evaluation (4) runs as without it (Note [Dynamic CP in the Trainer] in hf/grid.py).

5. Errors. What the trainer cannot serve raises on every rank when it is built. An error that depends on a
   batch (padding inside a row, an unsupported mask) is agreed by the ring's check within the CP group
   (Note [Agreeing before the ring] in core/checks.py); with several data-parallel replicas each forward
   (``compute_loss``, ``prediction_step``) is then followed by one all-gather over the world of whether it
   raised, so the other replicas raise too instead of waiting in the gradient all-reduce.

Note [compute_loss under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without CP, a loss that ``compute_loss`` normalises by ``num_items_in_batch`` (the world's label count) is
multiplied by the number of processes where the code knows DDP averages over them: the Trainer's and
TRL's ``loss * accelerator.num_processes // get_tp_size()``; a subclass's own loss (``sum / num_items_in_batch``)
may not. Under CP each rank's loss is its shard's part of the replica's, and DDP averages over P times as many
ranks. So ``compute_loss`` calls the trainer class's ``compute_loss`` with the trainer's accelerator seen
through :class:`_ReplicaView` -- ``num_processes`` counts the replicas (what CP=1 counts), and
``gather_for_metrics`` of per-rank scalars (TRL's token accuracy and entropy sums) keeps every rank of the
replicas whose rows CP=1 keeps in a partial last batch, not the first ranks -- and multiplies the result by P.
Per rank (r, c) with replica r's CP=1 loss L_r = sum_c L_rc: P L_rc, averaged over P x dp ranks = the mean of
L_r over dp ranks, for every loss code that is linear in its shard's token losses. Where the caller passes
no count (TRL's evaluation: CP=1 takes the rank's own mean), it is the replica's label count (an all-reduce
over the CP group) and ``num_processes`` is 1. The model call gets the replica's count too
(``inputs["num_items_in_batch"]``): a subclass that returns ``model(**inputs).loss`` gets the replica's mean
as CP=1 does. Calls nested inside (``self.compute_loss`` from a subclass's ``compute_loss``) are not rescaled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from .._extras import require, torchao_import_quiet

require("hf", "cp_dtensor.hf.with_context_parallel (the transformers Trainer under context parallelism)")
require("trainer", "cp_dtensor.hf.with_context_parallel (the transformers Trainer under context parallelism)")

with torchao_import_quiet():  # its quantizers import torchao: See Note [torchao's import noise] in _extras.py
    from transformers import Trainer

from .._compat import mesh_flatten, replica_dataloaders, seq2seq_pad  # noqa: E402
from ..core.batch import unshard_batch  # noqa: E402
from ..core.checks import options_error  # noqa: E402
from ..core.exchange.comm import all_gather_objects, host_group  # noqa: E402
from ..core.tiling import check_tile_size  # noqa: E402
from .attention import apply_context_parallel  # noqa: E402
from .collator import META, CollatedBatch, ShardingCollator  # noqa: E402
from .documents import KWARG, check_model_layout, model_windows  # noqa: E402
from .grid import dynamic_refusal, move_batches, replica_ring, static_collator  # noqa: E402
from .latent import latent_error, ring_exchange  # noqa: E402
from .sparse import ddp_error  # noqa: E402
from .state import implementations, state_of  # noqa: E402

__all__ = ["ShardingCollator", "with_context_parallel"]


@dataclasses.dataclass(frozen=True)
class CPOptions:
    """What ``with_context_parallel`` was called with (one frozen bundle per subclass)."""

    cp_size: int  #: CP ranks per data-parallel replica; the world size must be a multiple
    layout: str = "striped"  #: the sequence layout (striped / headtail / contiguous / documents); hybrids: headtail, contiguous
    documents: str | None = "position_ids"  #: apply_context_parallel's documents= (None: transformers' own rule)
    comm_dtype: Any = None  #: ring_attention's comm_dtype (K/V's dtype on the wire; None: as they are)
    kv_exchange: str = "ring"  #: ring_attention's kv_exchange ("ring" or "allgather"), or "latent" (MLA: hf/latent.py)
    sequence_tiling: bool | int = False  #: apply_context_parallel's sequence_tiling= (True, or tokens per tile)
    dynamic: bool = False  #: layout="documents": each step's global batch planned over the dp x cp grid (hf/grid.py)

    def __post_init__(self):
        if isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"cp_size must be a positive int; got {self.cp_size!r}.")
        ring = ring_exchange(self.kv_exchange)  # "latent": the MLA layers' own, checked with the model
        check_model_layout(self.layout, comm_dtype=self.comm_dtype, kv_exchange=ring)
        if self.documents not in (None, "position_ids"):
            raise ValueError(f"documents must be None or 'position_ids'; got {self.documents!r}.")
        error = options_error("with_context_parallel", comm_dtype=self.comm_dtype, kv_exchange=ring)
        if error is not None:
            raise ValueError(error)
        check_tile_size(self.sequence_tiling)
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be True or False; got {self.dynamic!r}.")
        if self.dynamic and self.layout != "documents":
            raise ValueError("dynamic=True plans each step's packed documents over the dp x cp grid: it needs "
                             f"layout='documents'; got layout={self.layout!r}. Pass layout='documents' (or drop "
                             "dynamic=True).")
        if self.dynamic and self.sequence_tiling:
            raise ValueError("dynamic=True with sequence_tiling is not served; drop one of them.")


def _causal_lm(model) -> bool:
    """Whether ``model`` is a causal language model (transformers' ``...ForCausalLM`` classes): the heads whose
    loss is a sum over tokens, each token's from its own hidden state -- what a rank's shard can compute."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names |= set(v) if isinstance(v, (tuple, list)) else {v}
    return any(c.__name__ in names or c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)


def _refusal(trainer, options: CPOptions) -> str | None:
    """What this trainer's configuration cannot run under CP: the same on every rank, no communication."""
    args, world = trainer.args, trainer.args.world_size
    if not _causal_lm(trainer.model):
        return (f"{type(trainer.model).__name__} is not a causal language model (...ForCausalLM): under CP a rank holds "
                "a shard of each sequence, so heads that pool a sequence or read tokens the rank does not hold "
                "(sequence classification, question answering) cannot run. Train a ...ForCausalLM model.")
    if world % options.cp_size:
        return (f"cp_size={options.cp_size} must divide the world size ({world} processes): each data-parallel "
                f"replica is cp_size ranks. Launch a multiple of {options.cp_size} processes.")
    if trainer.is_deepspeed_enabled:
        return "DeepSpeed is not supported under cp_dtensor's context parallelism; use DDP or FSDP2."
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (pc.cp_size > 1 or pc.tp_size > 1 or getattr(pc, "sp_size", 1) > 1):
        return (f"accelerate's ParallelismConfig asks for cp_size={pc.cp_size}, tp_size={pc.tp_size}, "
                f"sp_size={getattr(pc, 'sp_size', 1)}; with_context_parallel runs CP itself. Keep only dp_shard_size "
                "/ dp_replicate_size (FSDP2 over every rank, CP ranks included) and set cp_size in with_context_parallel.")
    if args.n_gpu > 1:
        return f"torch.nn.DataParallel ({args.n_gpu} GPUs in one process) is not supported; launch one process per GPU."
    if not args.average_tokens_across_devices:
        return ("average_tokens_across_devices=False normalises each rank's loss by its own tokens; under CP a rank "
                "holds a shard of each sequence, so the loss must be normalised by the global token count. Set "
                "average_tokens_across_devices=True.")
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        return ("compute_loss_func and label_smoothing_factor compute the loss from this rank's logits with labels "
                "shifted inside its shard; under CP the labels must be shifted on the full row (shift_labels). Drop "
                "them and write the loss in a compute_loss override that uses inputs['shift_labels'] and divides by "
                "num_items_in_batch: docs/trainer.md, 'Your own loss', shows one (label smoothing included).")
    if not trainer.model_accepts_loss_kwargs:
        return (f"{type(trainer.model).__name__}.forward takes no loss keyword arguments (num_items_in_batch), so "
                "the loss cannot be normalised by the global token count. Use a transformers model whose forward "
                "accepts **kwargs.")
    if args.train_sampling_strategy == "batch_rebalance":
        return "train_sampling_strategy='batch_rebalance' counts ranks, not replicas; use 'random' or 'group_by_length'."
    if "inputs" in (args.include_for_metrics or ()):
        return "include_for_metrics=['inputs'] would gather each rank's shard of the inputs; drop 'inputs'."
    if world > 1 and not getattr(trainer, "is_fsdp_enabled", False):  # DDP wraps the model: find_unused_parameters
        find_unused = args.ddp_find_unused_parameters  # as the Trainer sets it (a PreTrainedModel: off when checkpointing)
        if find_unused is None:
            checkpointing = getattr(trainer.model, "is_activation_checkpointing", None)
            find_unused = checkpointing is None or not (checkpointing or getattr(args, "activation_checkpointing", None)
                                                        or getattr(args, "gradient_checkpointing", None))
        error = ddp_error(trainer.model, find_unused, bool(getattr(args, "ddp_static_graph", None)))
        if error is not None:
            return error
    if options.kv_exchange == "latent":  # opt-in: Note [MLA latents on the wire] in hf/latent.py
        error = latent_error(trainer.model, implementations(trainer.model.config), options.comm_dtype)
        if error is not None:
            return error
    return dynamic_refusal(args, options.cp_size) if options.dynamic else None


class _ContextParallel:
    """The overrides; ``with_context_parallel`` puts this class before the trainer class in the MRO."""

    _cp_options: CPOptions
    _cp_evaluating = False  #: dynamic=True, inside the evaluation loop: the static documents path

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options = self._cp_options
        error = _refusal(self, options)
        if error is not None:  # configuration only: every rank raises alike, before any collective
            raise ValueError(error)
        cp, world = options.cp_size, self.args.world_size
        device = self.args.device.type
        if world > 1 and not dist.is_initialized():
            raise ValueError("context parallelism needs torch.distributed; launch with torchrun.")
        if world == 1 and not dist.is_initialized():  # one process (cp_size=1): a group of one for the mesh
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.cp_mesh_2d = init_device_mesh(device, (world // cp, cp), mesh_dim_names=("dp_replicate", "cp"))
        self.cp_mesh = self.cp_mesh_2d["cp"]
        # dynamic: the grid's ranks as one group (flat rank d * cp + c), the ring's and the loss count's
        self.cp_grid = mesh_flatten(self.cp_mesh_2d) if options.dynamic else None
        ring = self.cp_mesh if self.cp_grid is None else self.cp_grid
        apply_context_parallel(self.model, ring, layout=options.layout, documents=options.documents,
                               comm_dtype=options.comm_dtype, kv_exchange=options.kv_exchange,
                               sequence_tiling=options.sequence_tiling)
        self.data_collator = ShardingCollator(self.data_collator, self.cp_mesh, layout=options.layout,
                                              windows=model_windows(self.model.config), dynamic=options.dynamic)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """dynamic=True: the step's micro-batches planned over the dp x cp grid and moved, then counted (Note
        [Dynamic CP in the Trainer] in hf/grid.py)."""
        if self.cp_grid is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        batches = move_batches(batches, self.cp_grid, self.cp_mesh.size(), model_windows(self.model.config))
        return batches, self._get_num_items_in_batch(batches, device)

    # -- data: replicas, not ranks ------------------------------------------------------------------
    def get_train_dataloader(self):
        with replica_dataloaders(self.accelerator, self.cp_mesh_2d, self.train_dataset):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        with replica_dataloaders(self.accelerator, self.cp_mesh_2d, eval_dataset or self.eval_dataset), \
                self._cp_static():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with replica_dataloaders(self.accelerator, self.cp_mesh_2d, test_dataset), self._cp_static():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _cp_static(self, ring: bool = False):
        """dynamic=True: evaluation's static documents path inside the block -- its dataloaders get the static
        collator; with ``ring``, the evaluation loop runs the model's ring over the replica's CP group and
        ``compute_loss`` counts over the replica (Note [Dynamic CP in the Trainer] in hf/grid.py)."""
        if self.cp_grid is None or self._cp_evaluating:
            yield
            return
        collator = self.data_collator
        self.data_collator = static_collator(collator)
        try:
            if not ring:
                yield
                return
            with replica_ring(self.model, self.cp_mesh):
                self._cp_evaluating = True
                yield
        finally:
            self.data_collator, self._cp_evaluating = collator, False

    def get_total_train_batch_size(self, args) -> int:
        return super().get_total_train_batch_size(args) // self._cp_options.cp_size  # samples, over replicas

    def _cp_take(self, inputs: dict) -> tuple[dict, CollatedBatch]:
        """Pop the private key; check that every CP rank holds the same batch (one tiny all-gather)."""
        if META not in inputs:
            raise ValueError("this batch did not come through the CP collator (ShardingCollator): the Trainer's "
                             "dataloaders wrap it; a custom get_*_dataloader must use self.data_collator.")
        inputs = dict(inputs)
        meta = inputs.pop(META)
        state = state_of(self.model)
        if state is not None:  # CP's own padding, left out of the router loss (Note [Router loss under CP])
            state.real = meta.real
        if meta.plan is not None:  # layout="documents": the batch's plan, for every layer of the model call
            inputs[KWARG] = meta.plan
        cp = self.cp_mesh.size()
        if cp > 1:  # over the world, so that every replica raises, not only the one that differs
            every = all_gather_objects(meta.fingerprint, host_group(dist.group.WORLD))
            bad = [r // cp for r in range(0, len(every), cp) if len(set(every[r:r + cp])) > 1]
            if bad:
                raise ValueError(
                    f"the CP ranks of data-parallel replica(s) {bad} were handed different batches (fingerprints "
                    f"{every}): a sampler that counts ranks instead of replicas, a dataloader not built by the "
                    "Trainer's get_*_dataloader, or a collator that draws random numbers. Every CP rank must collate "
                    "the same examples alike.")
        return inputs, meta

    def _cp_agreed(self, forward):
        """``forward()``, and with several data-parallel replicas one all-gather over the world of whether it
        raised: an error that depends on one replica's data (padding inside a row, say) is agreed by that
        replica's CP ranks only (the ring's check), and the other replicas would wait in the gradient all-reduce
        until the process group's timeout. So every rank raises, before any backward. See Note [The Trainer
        under CP] 5."""
        cp, world = self.cp_mesh.size(), self.args.world_size
        if world == cp:  # one replica: the ring's agreement already raises on every rank
            return forward()
        error = None
        try:
            out = forward()
        except Exception as e:  # noqa: BLE001 -- handed to every rank below
            error = e
        every = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}",
                                   host_group(dist.group.WORLD))
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(every) if e is not None]
        if failed:
            r, e = failed[0]
            raise RuntimeError(f"data-parallel replica {r // cp} (rank {r}) failed this step, so every rank stops "
                               f"before the gradient all-reduce: {e}")
        return out

    # -- training ----------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.world_size > 1 and not _reduces_gradients(model):  # every rank alike, before the ring
            raise ValueError(
                "with_context_parallel: the model trains without DDP or FSDP, so the CP ranks' gradients would never "
                "be summed and each rank would step on its own tokens' gradient. accelerate leaves the model "
                "unwrapped for train() when evaluate() or predict() ran first on this trainer (it marks the model "
                "prepared without wrapping it). Call train() first (eval_on_start=True evaluates inside it), or "
                "evaluate with another trainer built on the same model.")
        inputs, self._cp_meta = self._cp_take(inputs)  # the meta's ``real``: for TRL's token count
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The trainer class's compute_loss, as if each replica were one process, times P: see Note
        [compute_loss under CP]."""
        if getattr(self, "_cp_in_loss", False):  # nested (a subclass calling self.compute_loss): scaled outside
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        cp, processes = self.cp_mesh.size(), self.args.world_size // self.cp_mesh.size()
        group = self.cp_mesh
        if self.cp_grid is not None and not self._cp_evaluating:  # every rank a process of the average; its
            cp, processes, group = 1, self.args.world_size, self.cp_grid  # tokens' part of the global batch
        if inputs.get("shift_labels") is not None:
            replica = (inputs["shift_labels"] != -100).sum()  # the replica's count (dynamic: the grid's)
            if group.size() > 1:
                dist.all_reduce(replica, group=group.get_group())
            if num_items_in_batch is None:  # CP=1 normalises by the rank's own count: the replica's here
                num_items_in_batch, processes = replica, 1
            inputs = {**inputs, "num_items_in_batch": replica}
        accelerator, counted = self.accelerator, getattr(self, "_total_train_tokens", None)
        self.accelerator, self._cp_in_loss = _ReplicaView(accelerator, processes, cp), True
        try:
            out = self._cp_agreed(lambda: super(_ContextParallel, self).compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch))
            if counted is not None and getattr(self, "_total_train_tokens", None) != counted:
                self._cp_trl_tokens(inputs)
        finally:
            self.accelerator, self._cp_in_loss = accelerator, False
        if cp == 1:
            return out
        return (out[0] * cp, *out[1:]) if isinstance(out, tuple) else out * cp

    # -- token counts: CP=1's (the layout's padding left out) ----------------------------------------
    def _cp_trl_tokens(self, inputs) -> None:
        """TRL's ``num_tokens`` (``_total_train_tokens``) without the layout's padding: a padding-free batch counts
        position_ids.size(1) a rank; its pad tokens, gathered as TRL gathers (every rank joins), come off."""
        if "attention_mask" in inputs or not isinstance(inputs.get("position_ids"), Tensor):
            return  # the mask's sum leaves the padding out already (the collator pads the mask with 0)
        real = getattr(getattr(self, "_cp_meta", None), "real", None)
        row = None if real is None else real.reshape(-1, real.shape[-1])[0]  # TRL counts one row's length
        pad = inputs["position_ids"].new_tensor(0 if row is None else int((~row).sum()))
        pads = int(self.accelerator.gather_for_metrics(pad).sum().item())
        self._total_train_tokens -= pads // max(1, getattr(self, "_tp_size", 1))
        metrics = getattr(self, "_metrics", {}).get("train", {})
        if "num_tokens" in metrics:
            metrics["num_tokens"] = [self._total_train_tokens]

    def floating_point_ops(self, inputs):
        return super().floating_point_ops(_real_tokens(inputs))

    def _track_num_input_tokens(self, inputs):  # transformers' private counter of num_input_tokens_seen
        return super()._track_num_input_tokens(_real_tokens(inputs))

    # -- evaluation --------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        inputs, meta = self._cp_take(inputs)
        with self._cp_static(ring=True):  # dynamic=True, called outside the evaluation loop: its static path too
            return self._cp_agreed(lambda: self._cp_predict(model, inputs, meta, prediction_loss_only, ignore_keys,
                                                            gen_kwargs))

    def _cp_predict(self, model, inputs: dict, meta: CollatedBatch, prediction_loss_only, ignore_keys, gen_kwargs):
        if getattr(self.args, "predict_with_generate", False) and not prediction_loss_only:
            return self._cp_generate(model, inputs, meta, ignore_keys, gen_kwargs)
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        cp = self.cp_mesh.size()
        if loss is not None and cp > 1:  # the replica's loss: what the Trainer computes on dp ranks without CP
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.cp_mesh.get_group())
            loss = loss / cp
        s_local = inputs["input_ids"].shape[1]
        full = lambda x: self._cp_full(x, s_local, meta)  # noqa: E731
        if isinstance(logits, (tuple, list)):
            logits = type(logits)(full(x) for x in logits)
        else:
            logits = full(logits)
        return loss, logits, full(labels)

    def _cp_generate(self, model, inputs: dict, meta: CollatedBatch, ignore_keys, gen_kwargs):
        """Seq2SeqTrainer's predict_with_generate: the loss under CP from the shards; the trainer's own generation
        step on the full batch (as the collator made it, labels aside), which every CP rank passes alike to the
        model's generate() -- a ring prefill, then decoding from a sequence-sharded cache (Note [generate() under
        CP] in hf/generate.py)."""
        loss = None
        if inputs.get("shift_labels") is not None:
            loss, _, _ = self.prediction_step(model, {**inputs, META: meta}, True, ignore_keys=ignore_keys)
        s_local = inputs["input_ids"].shape[1]
        full = {k: self._cp_full(v, s_local, meta) for k, v in inputs.items() if k not in (*meta.added, KWARG)}
        labels = full.pop("labels", None)
        _, generated, _ = super().prediction_step(model, full, False, ignore_keys=ignore_keys, **gen_kwargs)
        if labels is not None and generated is not None and labels.shape[-1] < generated.shape[-1]:
            labels = seq2seq_pad(self, labels, generated.shape[-1])  # the trainer's own padding of labels
        return loss, generated, labels

    def _cp_full(self, x, s_local: int, meta: CollatedBatch):
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[1] != s_local:
            return x
        layout = self._cp_options.layout if meta.plan is None else meta.plan
        return unshard_batch(x, self.cp_mesh, layout=layout)[:, :meta.length]

    def evaluation_loop(self, *args, **kwargs):
        # the Trainer resets gather_function to gather_for_metrics when the loop ends; a subclass may have chosen
        # another (Seq2SeqTrainer: accelerator.gather, which keeps the even-batches padding)
        self.gather_function = functools.partial(self._cp_gather, chosen=self.gather_function)
        with self._cp_static(ring=True):  # dynamic=True: the static documents path (Note [Dynamic CP in the Trainer])
            return super().evaluation_loop(*args, **kwargs)

    def _cp_gather(self, data, use_gather_object: bool = False, *, chosen=None):
        """The trainer's gather (accelerate's gather_for_metrics or gather) over the dp replicas: each replica's
        rows once. See Note [The Trainer under CP] 4."""
        from accelerate.utils import gather_object, recursively_apply

        plain = chosen == self.accelerator.gather  # no even-batches truncation
        use_gather_object = (use_gather_object or getattr(chosen, "keywords", {}).get("use_gather_object", False)
                             or not _all_tensors(data))
        cp, world = self.cp_mesh.size(), self.args.world_size
        if use_gather_object:
            every = gather_object(data)
            k = len(every) // world
            data = [x for r in range(0, world, cp) for x in every[r * k:(r + 1) * k]]
        else:
            keep = lambda x: x.reshape(world // cp, cp, -1, *x.shape[1:])[:, 0].reshape(-1, *x.shape[1:])  # noqa: E731
            data = recursively_apply(keep, self.accelerator.gather(data))
        state = self.accelerator.gradient_state
        if not plain and state.end_of_dataloader and state.remainder > 0:  # as gather_for_metrics drops the padding
            cut = lambda x: x[: state.remainder]  # noqa: E731
            data = cut(data) if isinstance(data, list) else recursively_apply(cut, data)
        return data


class _ReplicaView:
    """The trainer's accelerator as ``compute_loss`` sees it under CP: each data-parallel replica one process.
    See Note [compute_loss under CP]. Everything else is the accelerator's."""

    def __init__(self, accelerator, processes: int, cp: int):
        object.__setattr__(self, "_cp_view", (accelerator, processes, cp))

    @property
    def num_processes(self) -> int:
        return self._cp_view[1]

    def gather_for_metrics(self, data, use_gather_object: bool = False):
        """Per-rank scalars (partial sums over the rank's shard): every rank of the replicas whose rows accelerate
        keeps (a partial last batch keeps the first ``remainder`` replicas' P ranks, CP=1 the first ``remainder``
        ranks). Anything else: the accelerator's."""
        from accelerate.utils import recursively_apply

        accelerator, _, cp = self._cp_view
        if use_gather_object or not _all_tensors(data, scalar=True):
            return accelerator.gather_for_metrics(data, use_gather_object=use_gather_object)
        data = accelerator.gather(data)  # [world] per scalar, replica-major
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda x: x[: state.remainder * cp], data)
        return data

    def __getattr__(self, name):
        return getattr(self._cp_view[0], name)

    def __setattr__(self, name, value):
        setattr(self._cp_view[0], name, value)


def _real_tokens(inputs):
    """The batch without the layout's padding, for the Trainer's token counters (numel, mask sums)."""
    meta = inputs.get(META) if isinstance(inputs, Mapping) else None
    real = getattr(meta, "real", None)
    if real is None:
        return inputs
    n = real.shape[-1]
    if real.dim() == 2:  # a plan's: each row its own positions -- the real tokens as one row [1, K]
        return {k: v[real][None] if isinstance(v, Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(real.shape)
                else v for k, v in inputs.items() if k != META}
    return {k: v[:, real] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] == n else v
            for k, v in inputs.items() if k != META}


def _all_tensors(data, scalar: bool = False) -> bool:
    if isinstance(data, Tensor):
        return data.dim() == 0 or not scalar
    if isinstance(data, Mapping):
        return all(_all_tensors(v, scalar) for v in data.values())
    if isinstance(data, (tuple, list)):
        return all(_all_tensors(v, scalar) for v in data)
    return False


def _unserved_trl(trainer_cls: type) -> bool:
    """A TRL trainer other than SFTTrainer (DPO, GRPO, KTO, RLOO, reward, distillation, ...)."""
    trl_classes = [c for c in trainer_cls.__mro__ if c.__module__.split(".")[0] == "trl"]
    if not trl_classes:
        return False
    from trl import SFTTrainer

    return not issubclass(trainer_cls, SFTTrainer)


def _reduces_gradients(model) -> bool:
    """Whether the model the Trainer trains sums its gradients over the ranks (DDP, FSDP or FSDP2)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    return isinstance(model, wrappers) or any(isinstance(m, wrappers) for m in model.modules())


def with_context_parallel(trainer_cls: type, *, cp_size: int, layout: str = "striped", **options) -> type:
    """A subclass of ``trainer_cls`` (transformers' ``Trainer`` or any subclass: TRL's ``SFTTrainer``, ...) that
    trains and evaluates the model under context parallelism, ``cp_size`` ranks per data-parallel replica.

    Replace the class in the script and launch with torchrun (a multiple of ``cp_size`` processes)::

        trainer = with_context_parallel(Trainer, cp_size=2)(model=model, args=args, train_dataset=ds, ...)

    Serves what ``cp_dtensor.hf`` serves -- packed rows (``DataCollatorWithFlattening``, TRL's ``packing`` /
    ``padding_free``: documents from ``position_ids``), padding masks, sliding windows, sinks, hybrid
    linear-attention models (``layout="headtail"``) -- on CPU (gloo) and GPU, with DDP or FSDP2.
    ``layout="documents"``: the collator plans each batch's packed documents from the full rows and the step
    passes the plan to the model (Note [One plan per batch in transformers] in hf/documents.py). ``options``:
    ``documents`` (``"position_ids"``, the default, or ``None``: transformers' own packed-sequence rule),
    ``comm_dtype`` and ``kv_exchange`` (``ring_attention``'s, for every ring call of the model; ``"latent"``:
    a multi-head latent attention model's latent rows on the wire, opt-in -- hf/latent.py),
    ``sequence_tiling`` (True or tokens per tile: the LM head + loss and the MLPs in sequence tiles, no
    [S_local, vocab] logits in training steps; evaluation still returns logits -- hf/tiling.py), ``dynamic``
    (with ``layout="documents"``: each training step's global batch planned over every dp x cp rank; evaluation
    runs the static documents path -- Note [Dynamic CP in the Trainer] in hf/grid.py). See
    Note [The Trainer under CP]; what cannot be served raises on every rank when the trainer is built. A
    ``compute_loss`` override takes ``inputs["shift_labels"]`` and divides by ``num_items_in_batch`` (docs/trainer.md,
    "Your own loss"). ``predict()``'s logits at padding positions (attention_mask 0) are not CP=1's: a pad token
    attends to itself only under CP, to the row's tokens at CP=1 (they carry no label).
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_context_parallel takes transformers.Trainer or a subclass; got {trainer_cls!r}.")
    if issubclass(trainer_cls, _ContextParallel):
        raise ValueError(f"{trainer_cls.__name__} already runs under context parallelism.")
    if _unserved_trl(trainer_cls):
        raise ValueError(
            f"TRL's {trainer_cls.__name__} computes its loss from per-sequence log-probabilities or rewards (sums over "
            "each completion's tokens, the last token's score), of which a CP rank holds a shard only. Among TRL's "
            "trainers, SFTTrainer (and its subclasses) is served.")
    unknown = sorted(set(options) - {"documents", "comm_dtype", "kv_exchange", "sequence_tiling", "dynamic"})
    if unknown:
        raise TypeError(f"with_context_parallel got unknown options {unknown}; it takes cp_size, layout, documents, "
                        "comm_dtype, kv_exchange, sequence_tiling, dynamic.")
    bundle = CPOptions(cp_size=cp_size, layout=layout, **options)
    name = f"ContextParallel{trainer_cls.__name__}"
    return type(name, (_ContextParallel, trainer_cls), {"_cp_options": bundle, "__module__": trainer_cls.__module__,
                                                        "__qualname__": name, "__doc__": trainer_cls.__doc__})
