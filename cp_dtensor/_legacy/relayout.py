"""The old module path ``cp_dtensor.relayout`` (now ``cp_dtensor.dtensor.sharding``). ``cp_dtensor.relayout``
is also the public function, so this module is callable: ``cp_dtensor.relayout(x, placements)`` keeps
working after ``import cp_dtensor.relayout``, and its attributes are the new module's."""

import importlib
import sys
import types

from cp_dtensor._deprecated import warn_once

warn_once("cp_dtensor.relayout (the module)", "cp_dtensor.dtensor.sharding", stacklevel=3)
_new = importlib.import_module("cp_dtensor.dtensor.sharding")


class _CallableModule(types.ModuleType):
    def __getattr__(self, name: str):
        return getattr(_new, name)

    def __call__(self, *args, **kwargs):
        return _new.relayout(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
