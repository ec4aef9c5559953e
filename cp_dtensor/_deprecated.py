"""Old names that keep working: each warns once per process (``FutureWarning``, shown by default) and
then behaves exactly as before.

* Old module paths (``cp_dtensor.layout``, ``cp_dtensor.core.ring``, ``cp_dtensor.titan.spec``, ...) are one
  table, ``MOVED_MODULES``, read by one finder (Note [Old module paths]): importing one warns and binds the
  module's new home under the old name (the same module object, so everything in it, monkeypatching
  included, still works).
* Renamed functions and keyword arguments: ``renamed`` wraps the new function.

Nothing here runs at ``import cp_dtensor`` but ``install_old_paths``; a name warns when it is first used -- in
eager code: under ``torch.compile`` an old spelling is traced as its new one, without a warning (``warn_once``).

Note [Old module paths]
~~~~~~~~~~~~~~~~~~~~~~~
A moved module's old path is an entry of ``MOVED_MODULES``, not a file. ``import cp_dtensor`` appends one
finder, ``OldPaths``, to the end of ``sys.meta_path`` (once). Python asks it last, so only after its own
path finder found no file by that name; it answers only the names in the table -- every other name, inside
cp_dtensor or not, gets ``None`` and imports as it would without cp_dtensor. For an old name its loader warns
once and hands back the new module itself, which the import system then binds under the old name in
``sys.modules`` and on the parent package (the new module itself is not touched: its ``__spec__`` stays). ``cp_dtensor.relayout`` is also a public function, so that one
module is handed back as a callable module (``CALLABLE_MODULES``). ``python -m OLD`` runs the new module.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["MOVED_MODULES", "RENAMED", "OldPaths", "install_old_paths", "moved_module", "old_keywords", "renamed", "renamed_keyword", "seq_dim_argument",
           "warn_once"]

# old module path -> its new home (docs/architecture.md, "Where things moved")
# the core's modules, by the subpackage that holds them now
_CORE = {
    **{m: f"plan.{m}" for m in ("layout", "masks", "wire", "doc_plan", "documents", "spec")},
    **{m: f"compute.{m}" for m in ("kernels", "ops", "varlen", "ordering", "blocks")},
    **{m: f"exchange.{m}" for m in ("comm", "payload", "ring", "allgather", "ulysses", "doc_exchange", "doc_blocks",
                                    "doc_op")},
    **{m: f"linear.{m}" for m in ("linear_attention", "linear_conv", "linear_plan", "linear_runs", "linear_steps")},
}

MOVED_MODULES: dict[str, str] = {
    **{f"cp_dtensor.{m}": f"cp_dtensor.core.{_CORE.get(m, m)}" for m in (
        "layout", "masks", "wire", "payload", "kernels", "ops", "comm", "blocks", "ring", "allgather", "ulysses",
        "checks", "attention", "decode", "linear_attention")},
    **{f"cp_dtensor.core.{m}": f"cp_dtensor.core.{new}" for m, new in _CORE.items()},
    "cp_dtensor._agree": "cp_dtensor.core.agreement",
    "cp_dtensor._manifest": "cp_dtensor.checkpoint.manifest",
    "cp_dtensor.placement": "cp_dtensor.dtensor.placements",
    "cp_dtensor.dispatch": "cp_dtensor.dtensor.sdpa",
    "cp_dtensor.relayout": "cp_dtensor.dtensor.sharding",
    "cp_dtensor.hf_generate": "cp_dtensor.hf.generate",
    "cp_dtensor.hf_linear": "cp_dtensor.hf.linear",
    "cp_dtensor.module": "cp_dtensor.doors",
    "cp_dtensor.model": "cp_dtensor.doors",
    "cp_dtensor.plan": "cp_dtensor.tools.plan",
    "cp_dtensor.cli": "cp_dtensor.tools.cli",
    "cp_dtensor.debug": "cp_dtensor.tools.debug",
    "cp_dtensor.titan._cpu": "cp_dtensor.titan.shared.cpu",
    "cp_dtensor.titan.data": "cp_dtensor.titan.shared.data",
    "cp_dtensor.titan.float8": "cp_dtensor.titan.shared.float8",
    **{f"cp_dtensor.titan.{m}": f"cp_dtensor.titan.v02.{m}" for m in (
        "attention", "families", "flex", "resume", "spec", "validate")},
}

# old module paths that are also public functions: the module handed back calls it (Note [Old module paths])
CALLABLE_MODULES: dict[str, str] = {"cp_dtensor.relayout": "relayout"}

# old public name -> new public name (functions and arguments), filled by ``renamed``
RENAMED: dict[str, str] = {}

_warned: set[str] = set()


def _compiling() -> bool:
    """Whether torch.compile is tracing; torch-free where torch is not loaded (``cp-dtensor plan`` imports
    the torch-free layout math, which uses ``old_keywords``)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def warn_once(old: str, new: str, *, stacklevel: int = 3) -> None:
    """One ``FutureWarning`` per process for ``old``, naming ``new``; none while torch.compile traces (dynamo
    cannot trace ``warnings.warn``: an old spelling compiles, fullgraph too, as its new one does)."""
    if _compiling() or old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated and will be removed in a future release; use {new}.", FutureWarning,
                  stacklevel=stacklevel)


class _CallableModule(types.ModuleType):
    """An old module path that is also a public function: calls it; its attributes are the new module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._new, name)

    def __call__(self, *args, **kwargs):
        return getattr(self._new, self._call)(*args, **kwargs)


def moved_module(name: str) -> Any:
    """The new home of the old module path ``name``, warning once (Note [Old module paths])."""
    if name not in MOVED_MODULES:
        raise ImportError(f"{name} is not a module of cp_dtensor.")
    new = MOVED_MODULES[name]
    module = importlib.import_module(new)
    if name in CALLABLE_MODULES:
        warn_once(f"{name} (the module)", new, stacklevel=4)
        wrapper = _CallableModule(name, module.__doc__)
        wrapper._new, wrapper._call = module, CALLABLE_MODULES[name]
        return wrapper
    warn_once(name, new, stacklevel=4)
    return module


class OldPaths:
    """The import system's finder and loader of ``MOVED_MODULES`` (Note [Old module paths])."""

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(name, cls)

    @classmethod
    def create_module(cls, spec: Any) -> None:
        return None  # a blank module, replaced below: the new module's own __spec__ stays as it is

    @classmethod
    def exec_module(cls, module: Any) -> None:
        """Hand the new module over: the import system returns (and binds) what ``sys.modules`` holds."""
        sys.modules[module.__name__] = moved_module(module.__name__)

    @classmethod
    def get_code(cls, name: str) -> Any:
        """``python -m OLD``: warn once, then run the new module as the program."""
        if name not in MOVED_MODULES:
            raise ImportError(f"{name} is not a module of cp_dtensor.")
        warn_once(name, MOVED_MODULES[name], stacklevel=2)
        return compile(f"import runpy\nrunpy.run_module({MOVED_MODULES[name]!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{name}>", "exec")

    @classmethod
    def is_package(cls, name: str) -> bool:
        return False


def install_old_paths() -> None:
    """Put ``OldPaths`` at the end of ``sys.meta_path``, once (``import cp_dtensor`` calls this)."""
    if not any(f is OldPaths for f in sys.meta_path):
        sys.meta_path.append(OldPaths)


def renamed(new_fn: Callable, old: str, new: str, *, convert: Callable | None = None) -> Callable:
    """``new_fn`` under its old name ``old``: warns once, then calls ``new_fn`` (with the arguments
    passed through ``convert(args, kwargs) -> (args, kwargs)`` when the call changed shape)."""
    RENAMED[old] = new

    @functools.wraps(new_fn)
    def alias(*args, **kwargs):
        warn_once(old, new)
        if convert is not None:
            args, kwargs = convert(args, kwargs)
        return new_fn(*args, **kwargs)

    alias.__doc__ = f"Deprecated: {old} is now {new}.\n\n" + (new_fn.__doc__ or "")
    alias.__qualname__ = alias.__name__ = old.rpartition(".")[2]
    return alias


def renamed_keyword(kwargs: dict, old: str, new: str, where: str) -> dict:
    """``kwargs`` with the deprecated keyword ``old`` moved to ``new`` (warns once); both given: an error."""
    if old in kwargs:
        if new in kwargs:
            raise TypeError(f"{where} got both {new}= and its deprecated spelling {old}=; pass {new}= only.")
        warn_once(f"{where}({old}=...)", f"{where}({new}=...)", stacklevel=4)
        kwargs = dict(kwargs)
        kwargs[new] = kwargs.pop(old)
    return kwargs


def old_keywords(where: str, *, positional: tuple[str, ...] = (), npos: int = 0, **renames: str) -> Callable:
    """Decorator for a public function whose keywords were renamed (``renames``: old -> new, e.g. the CP
    group's ``group=`` / ``cp_mesh=`` -> ``mesh=``) or whose parameters ``positional`` became keyword-only
    after its first ``npos`` positional ones (``layout``): the old spellings keep working, each warning
    once, and stay out of the signature (``inspect.signature`` shows the new one)."""

    def wrap(fn: Callable) -> Callable:
        for old, new in renames.items():
            RENAMED[f"{where}({old}=)"] = f"{where}({new}=)"

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if len(args) > npos and positional:
                extra = args[npos:]
                if len(extra) > len(positional):
                    raise TypeError(f"{where}() takes {npos} positional arguments but {len(args)} were given")
                names = positional[: len(extra)]
                warn_once(f"{where}() with {', '.join(names)} passed by position",
                          f"{where}({', '.join(n + '=...' for n in names)})")
                for name, value in zip(names, extra):
                    if name in kwargs:
                        raise TypeError(f"{where}() got multiple values for argument {name!r}")
                    kwargs[name] = value
                args = args[:npos]
            for old, new in renames.items():
                kwargs = renamed_keyword(kwargs, old, new, where)
            return fn(*args, **kwargs)

        return inner

    return wrap


def seq_dim_argument(seq_dim: int | None, deprecated: dict, where: str) -> int:
    """``seq_dim``, or its old spelling ``dim=`` (warns once); any other keyword is a TypeError, as Python's."""
    if seq_dim is not None and "dim" in deprecated:
        raise TypeError(f"{where} got both seq_dim= and its deprecated spelling dim=; pass seq_dim= only.")
    given = renamed_keyword(deprecated, "dim", "seq_dim", where)
    extra = sorted(set(given) - {"seq_dim"})
    if extra:
        raise TypeError(f"{where}() got an unexpected keyword argument {extra[0]!r}")
    if seq_dim is None:
        seq_dim = given.get("seq_dim")
    if seq_dim is None:
        raise TypeError(f"{where}() missing the keyword argument 'seq_dim' (the sequence dimension)")
    return seq_dim
