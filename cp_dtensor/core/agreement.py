"""Errors that every rank raises alike: the one cross-rank agreement of every entry point.

The ring (checks.py), decoding (decode.py), linear attention (linear_attention.py), transformers'
generate() and hybrid models (hf/), torch's API (torch_api.py, :func:`agree_on_call`) agree on a call
with :func:`agree` or :func:`agree_objects` under their own :class:`Rules` (the entry point's name, its
fingerprint's fields, how a field reads); the checkpoints (checkpoint/dcp.py) agree on each phase of a
save or load with :func:`agreed`.

Note [One agreement]
~~~~~~~~~~~~~~~~~~~~
A bad argument on one rank must not leave the others blocked in a collective it never joins, and
ranks that disagree must not run (a ring of unequal shards moves messages of other sizes, or computes
wrong outputs silently). So an entry point does not raise its local checks at once: each rank condenses
its call into a fingerprint -- whether its local checks passed, then the fields that must be equal on
every rank, then values allowed to differ -- and one all-gather over the CP group's host (gloo) twin
(``comm.host_group``: no device sync) shows every rank every other rank's. Then every rank decides
alike:

* some rank failed: the error texts are gathered too (only then) and every rank raises
  ``ValueError("<what> rejected the inputs of rank(s) r, ...: <the first failing rank's error>")``;
* the fields differ: every rank raises ``ValueError("<what> needs the same <fields> on every rank of
  the CP group; got rank 0: field=value; rank 1: ...")`` with the entry point's advice;
* on one rank, its own error is raised as it is.

Three ways to send the fingerprint, by what the call is: ``agree`` with int64 fields (the ring: 20
ints a rank; linear attention), ``agree`` with ``Rules.digest`` (one int64 a rank, the fields gathered
only on a mismatch: decoding, once per generated token), ``agree_objects`` with picklable values (the
transformers wrappers, once per call). Each entry point's fields stay in its own module.

Note [Compiled agreement of the other ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``sharded_causal_conv1d``, ``sharded_delta_rule`` and ``sharded_cache_attention`` agree as the ring does
under ``torch.compile`` (Note [Compiled agreement] in checks.py), through one opaque op,
``cp_dtensor::agree_call_``: its arguments are the entry point's name (its :class:`Rules`, registered with
:func:`compiled_rules`), the fingerprint's shape-and-option ints (constants of each rank's graph), this
rank's local error text or None, the CP group's name, the tensors whose *values* the fingerprint reads
(:func:`digest`ed at run time: decoding's replicated queries) and a tensor to gather on the host (the conv's
document ids at the runs' ends). At run time it does what :func:`agree` does eagerly -- every rank raises
the same ``ValueError`` -- and returns the gathered tensor (an empty one without). The caller ties the first
collective's payload to that result (``tie_``), so no data moves before the agreement; with a local error
the caller returns a placeholder of the output's shape, tied the same way, that the op's raise never lets
anyone see. Data-dependent checks after the exchange (a decoded query that sees no key) are ops too
(``cp_dtensor::seen_or_raise`` in decode.py): the graph has no guard on a tensor's value.

Note [Agreeing on checkpoint errors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check that fails on one rank only (its share of the checksums, a file it could not read, a bad
argument) must not leave the others waiting in the next collective. Each phase of a save or load runs
its local work, then one all-gather of a short UTF-8 string per rank (an error, or a payload such as
the save token; raw bytes, nothing pickled): if any rank failed, every rank raises the error of the
lowest failing rank, as ``ValueError`` (a bad argument) or ``CheckpointError`` (a ``RuntimeError``:
the files), cause first. DCP's own failures arrive on every rank as its ``CheckpointException`` (a
``BaseException``, missed by ``except Exception``); they are re-raised as ``CheckpointError`` with the
first failing rank's exception first.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._compat import resolve_process_group
from .exchange.comm import Groups, all_gather_host, all_gather_objects, group_size, host_group

__all__ = ["SAME_SHARDS", "Rules", "agree", "agree_call_", "agree_compiled", "agree_objects", "agree_on_call", "agreed",
           "compiled_rules", "digest", "rank_world"]

SAME_SHARDS = "Every rank must hold an equal-length shard of one sequence and pass the same options."


def _as_written(field: str, value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Rules:
    """How one entry point agrees (Note [One agreement]); its fingerprint's fields are its own."""

    what: str  #: the entry point, as its errors name it ("ring_attention")
    fields: tuple[str, ...]  #: the fingerprint's values that must be equal on every rank, in order
    advice: str = SAME_SHARDS  #: the sentence after a mismatch's table
    describe: Callable[[str, Any], Any] = _as_written  #: a field's value as the caller wrote it
    free: int = 0  #: values after the fields, gathered along, that may differ between ranks
    digest: bool = False  #: send one int64 a rank; the fields travel only on a mismatch
    refused: str = "{what} rejected the inputs of rank(s) {ranks}: {error}"  #: keys: what, ranks, rank_list, error
    differ: str = "{what} needs the same {names} on every rank of the CP group; got {table}. {advice}"

    def raise_refused(self, errors: Sequence[str | None]) -> None:
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            ranks = [r for r, _ in bad]
            raise ValueError(self.refused.format(what=self.what, ranks=", ".join(map(str, ranks)), rank_list=ranks,
                                                 error=bad[0][1]))

    def raise_differ(self, rows: Sequence[Sequence[Any]]) -> None:
        """``rows``: every rank's fields; raises when they are not all equal."""
        names = [f for i, f in enumerate(self.fields) if any(row[i] != rows[0][i] for row in rows)]
        if names:
            table = "; ".join(f"rank {r}: " + ", ".join(f"{f}={self.describe(f, row[self.fields.index(f)])}"
                                                        for f in names) for r, row in enumerate(rows))
            raise ValueError(self.differ.format(what=self.what, names=", ".join(names), table=table,
                                                advice=self.advice))


def _digest(values: Sequence[int]) -> int:
    d = 0
    for x in values:
        d = (d * 1000003 + int(x)) % (1 << 62)
    return d


def _hosts(groups: Groups | None) -> tuple[dist.ProcessGroup, ...]:
    """The host (gloo) twins of ``groups``; () for one rank (no twin is made for it)."""
    groups = () if groups is None else groups if isinstance(groups, tuple) else (groups,)
    return tuple(host_group(g) for g in groups) if group_size(groups) > 1 else ()


def agree(rules: Rules, fingerprint: Sequence[int], error: str | None, groups: Groups | None) -> torch.Tensor | None:
    """Agree on a call across ``groups`` (a group, a 2-D mesh's (ring, Ulysses) groups, or None: one
    rank); see Note [One agreement]. ``fingerprint``: int64s, ``rules.fields`` then ``rules.free`` values
    (with an ``error``: placeholders of that length, compared with nothing). Raises the same ValueError
    on every rank, or returns every rank's fingerprint [P, len] int64 (``rules.digest``: None)."""
    hosts = _hosts(groups)
    world = group_size(hosts)
    if world == 1:
        if error is not None:
            raise ValueError(error)
        return None if rules.digest else torch.tensor([list(fingerprint)], dtype=torch.int64)
    if rules.digest:  # one int64 a rank: 0 where the local checks failed
        mine = torch.tensor([0 if error is not None else _digest(fingerprint) + 1], dtype=torch.int64)
        every = all_gather_host(mine, hosts).view(world)
        if bool((every == 0).any()):
            rules.raise_refused(all_gather_objects(error, hosts))
        if bool((every != every[0]).any()):
            rules.raise_differ(all_gather_objects(list(fingerprint), hosts))
        return None
    row = torch.tensor([int(error is None), *fingerprint], dtype=torch.int64)
    every = all_gather_host(row, hosts).view(world, -1)
    if not bool((every[:, 0] == 1).all()):
        rules.raise_refused(all_gather_objects(error, hosts))
    n = len(rules.fields)
    fields = every[:, 1 : 1 + n]
    if bool((fields != fields[0]).any()):
        rules.raise_differ(fields.tolist())
    return every[:, 1:]


def agree_objects(rules: Rules, fingerprint: tuple, error: str | None, groups: Groups | None, extra: Any = None) -> list:
    """:func:`agree` for picklable fingerprints (``rules.fields`` name its entries): one all-gather of
    (error, fingerprint, extra) objects. Returns every rank's ``extra``, in rank order."""
    hosts = _hosts(groups)
    if not hosts:
        if error is not None:
            raise ValueError(error)
        return [extra]
    every = all_gather_objects((error, fingerprint, extra), hosts)
    rules.raise_refused([e for e, _, _ in every])
    rules.raise_differ([f for _, f, _ in every])
    return [x for _, _, x in every]


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather_strings(text: str) -> list[str]:
    """Every rank's ``text`` (UTF-8 over the default group; two all-gathers, no pickling)."""
    if not dist.is_initialized():
        return [text]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = text.encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = max(1, max(int(s) for s in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(width, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(bufs, mine.to(device))
    return [b[: int(s)].cpu().numpy().tobytes().decode() for b, s in zip(bufs, sizes)]


def agreed(fn: Callable[[], Any], doing: str, payload: Callable[[Any], str] = lambda _: "", *,
           wrap: Callable[[Exception, str], Exception] = lambda e, doing: e,
           kinds: dict[str, type[Exception]] | None = None) -> list[str]:
    """Run ``fn`` here; raise on every rank if it raised on any; else every rank's ``payload(fn())``.
    ``wrap(e, doing)``: the exception this rank raises for ``e``; ``kinds``: exception class names the
    other ranks re-create (by the failing rank's class name; default ``RuntimeError``)."""
    err, text = None, ""
    kinds = {"ValueError": ValueError, **(kinds or {})}
    try:
        text = "P" + payload(fn())
    except Exception as e:  # noqa: BLE001 -- handed to every rank below
        err = wrap(e, doing)
        text = f"E{type(err).__name__}\0{err}"
    texts = _all_gather_strings(text)
    rank, world = rank_world()
    for r, t in enumerate(texts):
        if t.startswith("E"):
            if r == rank:
                raise err
            kind, msg = t[1:].split("\0", 1)
            cls = kinds.get(kind, kinds.get("", RuntimeError))
            raise cls(f"{msg} [rank {r} of {world}]")
    return [t[1:] for t in texts]


def agree_on_call(error: str | None, fingerprint: dict[str, int], group: dist.ProcessGroup, *, what: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` -- before the caller's first collective --
    when any rank's local checks failed (``error``: this rank's text, or None) or the ranks' ``fingerprint``
    (host ints, the same keys on every rank: lengths, options) differ: :func:`agree` with the keys as the
    fields (Note [One agreement]). The entry checks of ``torch_api.context_parallel`` and
    ``context_parallel_unshard``."""
    rules = Rules(what, tuple(fingerprint), refused="{what} rejected the arguments of rank(s) {ranks}: {error}",
                  advice="Every rank must pass the same arguments, with tensors of the same shapes.")
    agree(rules, list(fingerprint.values()), error, group)


def digest(x: torch.Tensor | None) -> int:
    """An exact fingerprint of a CPU tensor's bits (wrapping integer arithmetic: the same on every rank);
    -1 for none, -2 off the CPU (reading it there would wait for the device)."""
    if x is None:
        return -1
    if x.device.type != "cpu":
        return -2
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    flat = x.detach().contiguous().view(-1).view(ints).long()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) * 1000003 + 7
    return int((flat * weights).sum()) ^ (flat.numel() << 40)


_COMPILED: dict[str, Rules] = {}  # the entry points that agree inside a compiled graph, by name (constant rules)


def compiled_rules(rules: Rules) -> Rules:
    """Register ``rules`` for :func:`agree_compiled` (at import of the entry point's module); returns them."""
    _COMPILED[rules.what] = rules
    return rules


@torch.library.custom_op("cp_dtensor::agree_call_", mutates_args=("token",))
def agree_call_(token: torch.Tensor, what: str, fingerprint: list[int], texts: str, error: str | None,
                group: str, values: list[torch.Tensor], gather: torch.Tensor | None) -> torch.Tensor:
    """:func:`agree` as an op a compiled graph runs: see Note [Compiled agreement of the other ops]. ``texts``:
    crc32'd after the fingerprint (joined by ``_SEP``). Returns
    every rank's ``gather`` [P, *gather.shape] (on the host), or an empty tensor."""
    pg = resolve_process_group(group)
    fp = list(fingerprint) if error is not None else [*fingerprint, *(zlib.crc32(t.encode()) for t in _split(texts)),
                                                      *(digest(v) for v in values)]
    agree(_COMPILED[what], fp, error, pg)
    token.fill_(1)
    if gather is None:
        return token.new_empty(0)
    return all_gather_host(gather.detach().to("cpu").contiguous(), host_group(pg))


@agree_call_.register_fake
def _(token, what, fingerprint, texts, error, group, values, gather):
    if gather is None:
        return token.new_empty(0)
    return gather.new_empty((dist.get_world_size(resolve_process_group(group)), *gather.shape), device="cpu")


def agree_compiled(rules: Rules, fingerprint: Sequence[int], error: str | None, group: dist.ProcessGroup, *,
                   texts: Sequence[str] = (), values: Sequence[torch.Tensor] = (),
                   gather: torch.Tensor | None = None) -> torch.Tensor:
    """Inside a compiled graph, the agreement of ``rules`` (registered with :func:`compiled_rules`) over
    ``group``: the op's result, which the caller's first collective must wait for (``tie``). The fingerprint
    is ``fingerprint``, then the crc32 of each of ``texts``, then the :func:`digest` of each of ``values``
    (both read at run time; without an ``error``)."""
    token = torch.zeros(1, dtype=torch.int64)
    return agree_call_(token, rules.what, [int(x) for x in fingerprint], _SEP.join(texts), error, group.group_name,
                       list(values), gather)


_SEP = "\x1f"  # the texts travel as one string (an op's schema has no list of strings)


def _split(texts: str) -> list[str]:
    return texts.split(_SEP) if texts else []
