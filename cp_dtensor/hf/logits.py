"""The logits a tiled training call never formed: a [B, S_local, 0] tensor that raises when read.

Note [Logits a tiled call did not compute]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In a tiled training call (Note [Sequence tiling in transformers] in hf/tiling.py) the LM head hands the
hidden states to the loss and no [B, S_local, V] logits exist. What stands in the output's logits slot
must not pass for logits: an empty tensor gives an empty mean (nan) or a cross-entropy of inf that a
Trainer logs as 0.0, and the hidden states themselves (what ``return_dict=False`` used to return there)
a loss of the wrong width. So the slot holds :class:`TiledLogits`, [B, S_local, 0] like an empty tensor
for whatever only looks at it (its shape, dtype, device; ``isinstance(x, Tensor)``; ``detach`` /
``clone`` / ``to``, which the Trainer, DDP and accelerate apply to whole outputs; the strides and view
flags torch.compile reads when a compiled frame, such as DDP's post-forward under
``Trainer(torch_compile=True)``, meets it), while every operation
that reads values (``view``, indexing, ``softmax``, ``cross_entropy``, ``argmax``, ``float()`` then
anything) raises a ValueError naming the tiling and what to do instead. The slot is found by identity:
the tensor the head handed through, in a ``ModelOutput`` (``logits``) or the tuple of
``return_dict=False`` (after the loss, as the dict's order would put it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TiledLogits", "replace_logits"]

_MESSAGE = (
    "these logits were never computed: sequence_tiling ran this training call's LM head inside the loss (labels "
    "given, model.train()), so no [batch, seq, vocab] logits exist. Use outputs.loss; for logits, call the model "
    "without labels or in eval mode (model.eval()), or apply context parallelism without sequence_tiling. A Trainer "
    "compute_loss that reads outputs.logits needs sequence_tiling off. See Note [Logits a tiled call did not "
    "compute] in cp_dtensor/hf/logits.py.")
_LOOKS = {"size", "dim", "numel", "is_floating_point", "is_complex", "element_size", "requires_grad_",
          "__get__", "__len__",
          # what torch.compile reads when it meets a tensor in a frame (its metadata, never its values)
          "stride", "storage_offset", "is_contiguous", "_is_view", "untyped_storage", "is_inference", "_is_zerotensor",
          "is_neg", "is_conj"}
_KEEPS = {"detach", "clone", "to", "cpu", "cuda", "contiguous", "float", "half", "bfloat16", "double",
          "detach_"}  # another TiledLogits


class TiledLogits(Tensor):
    """A [B, S_local, 0] stand-in for logits a tiled call did not form: see Note [Logits a tiled call did not
    compute]."""

    @staticmethod
    def __new__(cls, like: Tensor) -> TiledLogits:  # like: [B, S_local, H], the hidden states the head handed on
        return Tensor._make_subclass(cls, like.detach().new_empty(*like.shape[:-1], 0), False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _LOOKS or name in _KEEPS:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            return Tensor._make_subclass(cls, out, False) if name in _KEEPS and isinstance(out, Tensor) else out
        raise ValueError(_MESSAGE)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"TiledLogits(shape={tuple(self.shape)}: never computed under sequence_tiling)"

    def __bool__(self):
        raise ValueError(_MESSAGE)


def replace_logits(output, handed: Tensor):
    """``output`` (a ModelOutput or a tuple) with the ``handed`` hidden states in its logits slot replaced by
    :class:`TiledLogits`."""
    if isinstance(output, tuple):
        return type(output)(TiledLogits(x) if x is handed else x for x in output)
    if getattr(output, "logits", None) is handed:
        output["logits"] = TiledLogits(handed)
    return output
