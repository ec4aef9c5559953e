"""Linear attention's plan, torch-free: the layouts it runs on, its agreement's fields and the bytes each
rank sends (Note [Linear attention under CP] in linear_attention.py), for the planner and the tests.
"""

from __future__ import annotations

__all__ = ["LINEAR_LAYOUTS", "check_bytes", "check_linear_layout", "conv_halo_bytes", "linear_layout_error",
           "linear_state_bytes"]

LINEAR_LAYOUTS = ("contiguous", "headtail")
_DELTA_FIELDS = ("batch", "seq_len_local", "k_heads", "k_dim", "v_heads", "v_dim", "gate", "dtype", "layout",
                 "document_ids", "use_qk_l2norm_in_kernel", "kernel", "kernel_kwargs")
_CONV_FIELDS = ("batch", "channels", "seq_len_local", "kernel_size", "dtype", "weight_dtype", "bias",
                "activation", "layout", "document_ids")


def check_linear_layout(layout: str) -> str:
    """``layout`` if linear attention runs on it; else the ValueError (the same on every rank)."""
    error = linear_layout_error(layout)
    if error is not None:
        raise ValueError(error)
    return layout


def linear_layout_error(layout) -> str | None:
    """:func:`check_linear_layout`'s error text, or None (no exception: a compiled graph formats it)."""
    if layout == "striped":
        return ("linear attention (gated delta rule) under CP needs each rank's tokens in contiguous runs; the "
                "'striped' layout makes every token its own run, whose [dk, dk + dv] state summary outweighs the "
                "token. Use layout='headtail' (load-balanced for the softmax layers of a hybrid model too) or "
                "'contiguous'.")
    if layout not in LINEAR_LAYOUTS:
        return f"unknown sequence layout {layout!r}; linear attention takes one of {', '.join(LINEAR_LAYOUTS)}."
    return None


def _runs(layout: str) -> int:
    return 2 if layout == "headtail" else 1


def linear_state_bytes(*, batch: int, heads: int, dk: int, dv: int, world: int, layout: str, itemsize: int = 4) -> int:
    """Bytes one rank sends per layer per forward for the state summaries ((P - 1) * runs * B * Hv * dk *
    (dk + dv) * 4); the backward's reduce-scatter of their gradients sends as many. ``heads``: value heads.
    ``itemsize`` 8 for float64 inputs. See Note [Linear attention under CP]."""
    return (world - 1) * _runs(check_linear_layout(layout)) * batch * heads * dk * (dk + dv) * itemsize


def conv_halo_bytes(*, batch: int, channels: int, kernel_size: int, world: int, layout: str, itemsize: int,
                    s_local: int | None = None, final_state: bool = False) -> int:
    """Bytes one rank sends per conv per forward for the halos (the backward sends as many): every run's
    last min(run length, K - 1) tokens, in x's dtype; min(run length, K) with ``final_state`` (the conv state
    for decoding). ``s_local`` None: runs at least K long."""
    runs = _runs(check_linear_layout(layout))
    width = kernel_size if final_state else kernel_size - 1
    tail = width if s_local is None else min(s_local // runs, width)
    return (world - 1) * runs * batch * channels * tail * itemsize


def check_bytes(*, world: int, conv: bool = False) -> int:
    """Bytes one rank sends for the agreement of one call (the fingerprint's all-gather, int64s)."""
    return (world - 1) * 8 * (1 + len(_CONV_FIELDS if conv else _DELTA_FIELDS))
