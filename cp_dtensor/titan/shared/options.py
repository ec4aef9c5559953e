"""The ``cp_dtensor`` options of a torchtitan job -- the ``[cp_dtensor]`` TOML section in 0.2.2, the
``cp_dtensor`` field of the config (``--cp_dtensor.layout`` ...) in 0.3 -- checked as they are built.
(No ``from __future__ import annotations`` here: tyro resolves the field types in torchtitan's namespace.)
"""

from dataclasses import dataclass

import torch

from ...core.plan.layout import LAYOUTS
from ...core.plan.wire import KV_EXCHANGES  # kv_exchange values, as ring_attention(kv_exchange=...) takes them
from ...core.tiling import check_tile_size

__all__ = ["COMM_DTYPES", "CPDTensor", "check_cli_spellings"]

COMM_DTYPES = {  # [cp_dtensor] comm_dtype -> the K/V ring payload dtype (see Note [float8 ring payload])
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass
class CPDTensor:
    """Context parallelism through cp_dtensor's ring attention (active when context_parallel_degree > 1)."""

    layout: str = "striped"
    """How the sequence is split over the CP ranks: "striped", "headtail", "contiguous", or "documents" (the
    batch's documents placed per batch from its document masks: Note [One plan per torchtitan batch])."""

    comm_dtype: str | None = None
    """dtype of the K/V blocks on the ring, e.g. "float8_e4m3fn" (about half of bf16's bytes); unset: the input dtype."""

    ulysses_degree: int = 1
    """U: heads all-to-all over U CP ranks, ring over the other CP / U (Note [Ulysses x ring]); must divide the CP degree."""

    kv_exchange: str = "ring"
    """How K/V reach every rank of the ring: "ring" (P - 1 hops) or "allgather" (one gather; Note [All-gather K/V])."""

    sequence_tiling: bool | int | str = False
    """The LM head + cross-entropy and the MLPs in sequence tiles (true: 1024 tokens a tile, or an int): no
    [S_local, vocab] logits in forward or backward (Note [Sequence tiling in torchtitan])."""
    # str: the command line's spelling of the TOML's true / false (``--cp_dtensor.sequence_tiling true``), which
    # the parser's bool takes only as True / False; __post_init__ turns it into the bool or int.

    dynamic: bool | str = False
    """With layout = "documents": one plan of the global batch over every dp_shard x cp rank each step (short
    documents whole on one rank, long ones cut over several; Note [One plan over the grid]), instead of each
    dp rank's rows on its own CP ranks. Logs the plan's balance each step."""
    # str: the command line's "true" / "false", as for sequence_tiling

    def __post_init__(self):
        if self.layout not in (*LAYOUTS, "documents"):
            raise ValueError(
                f"[cp_dtensor] layout must be one of {', '.join(LAYOUTS)}, documents; got {self.layout!r}. "
                'Set e.g. layout = "striped" in the TOML or pass --cp_dtensor.layout striped.'
            )
        if self.comm_dtype is not None and self.comm_dtype not in COMM_DTYPES:
            raise ValueError(
                f"[cp_dtensor] comm_dtype must be one of {', '.join(COMM_DTYPES)} or unset (the input dtype); "
                f'got {self.comm_dtype!r}. Set e.g. comm_dtype = "float8_e4m3fn" in the TOML, pass '
                "--cp_dtensor.comm_dtype float8_e4m3fn, or remove the key."
            )
        if not isinstance(self.ulysses_degree, int) or self.ulysses_degree < 1:
            raise ValueError(f"[cp_dtensor] ulysses_degree must be an integer >= 1; got {self.ulysses_degree!r}. "
                             "Set ulysses_degree = 1 (ring only) or a divisor of context_parallel_degree.")
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"[cp_dtensor] kv_exchange must be one of {', '.join(KV_EXCHANGES)}; got "
                             f'{self.kv_exchange!r}. Set kv_exchange = "ring" (or "allgather") in the TOML.')

        if isinstance(self.dynamic, str) and self.dynamic.strip().lower() in ("true", "false"):
            self.dynamic = self.dynamic.strip().lower() == "true"
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"[cp_dtensor] dynamic is true or false; got {self.dynamic!r}.")
        if self.dynamic and self.layout != "documents":
            raise ValueError(f'[cp_dtensor] dynamic = true plans the batch\'s documents over the dp x cp grid: it needs '
                             f'layout = "documents"; got layout = {self.layout!r}. Set layout = "documents" (with a '
                             'flex flavor whose masks mark documents, e.g. "debugmodel_flex_attn") or remove dynamic.')
        self.sequence_tiling = _tiling_value(self.sequence_tiling)
        try:
            check_tile_size(self.sequence_tiling)
        except ValueError as e:
            raise ValueError(f"[cp_dtensor] {e} Set sequence_tiling = true (or e.g. 2048) in the TOML, pass "
                             "--cp_dtensor.sequence_tiling 2048, or remove the key.") from None
        if self.layout == "documents":  # the document exchange: Note [Document exchange] in core/exchange/doc_exchange.py
            clash = [f"{name} = {value!r}" for name, value, default in (
                ("comm_dtype", self.comm_dtype, None), ("ulysses_degree", self.ulysses_degree, 1),
                ("kv_exchange", self.kv_exchange, "ring")) if value != default]
            if clash:
                raise ValueError(f'[cp_dtensor] layout = "documents" has its own exchange (each needed K/V row sent '
                                 f"once, in the input dtype, over a 1-D CP group); it does not take {', '.join(clash)}. "
                                 "Remove those keys, or use a named layout with them.")

    @property
    def tile_size(self) -> int | None:
        """Tokens per tile of ``sequence_tiling`` (None: off)."""
        return check_tile_size(self.sequence_tiling)

    @property
    def comm_torch_dtype(self) -> torch.dtype | None:
        """``comm_dtype`` as the torch dtype ``ring_attention`` takes (None: the input dtype)."""
        return None if self.comm_dtype is None else COMM_DTYPES[self.comm_dtype]


def _tiling_value(value):
    # "true" / "false" / "2048" from the command line as the TOML's true / false / 2048
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.isdigit() else value  # anything else: check_tile_size's error names the rule


# keys users reach for that the section spells otherwise -> the right key and how to write it
_SPELLINGS = {
    "tile_size": "sequence_tiling (e.g. --cp_dtensor.sequence_tiling 2048, or true for 1024 tokens a tile)",
    "tiling": "sequence_tiling (e.g. --cp_dtensor.sequence_tiling true)",
    "ulysses": "ulysses_degree (e.g. --cp_dtensor.ulysses_degree 2)",
}


def check_cli_spellings(argv: list[str]) -> None:
    """Raise, before torchtitan's parser says only "Unrecognized options", for a ``--cp_dtensor.<key>`` flag
    whose key the section spells otherwise (e.g. ``tile_size``: the key is ``sequence_tiling``)."""
    for arg in argv:
        if not arg.startswith(("--cp_dtensor.", "--cp-dtensor.")):
            continue
        key = arg.split(".", 1)[1].split("=", 1)[0].replace("-", "_")
        if key in _SPELLINGS:
            raise ValueError(f"{arg.split('=', 1)[0]}: the [cp_dtensor] section has no key {key!r}; "
                             f"its key is {_SPELLINGS[key]}.")
