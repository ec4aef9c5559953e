"""torchtitan plugin: context parallelism through cp_dtensor's ring attention, turned on from the TOML
(torchtitan 0.2.2: v02/) or from the config registry (torchtitan 0.3: v03/). shared/ holds what both use.

Importing this package (``[experimental] custom_import = "cp_dtensor.titan"`` in a 0.2.2 TOML,
``--module cp_dtensor.titan`` in 0.3, or ``python -m cp_dtensor.titan.train``) installs the plugin for
the installed torchtitan: see ``v02.install`` and ``v03.install``. The public names are the same under
both versions; a name that belongs to one version's way of configuring raises, under the other, an
error that names that version's way.
"""

from __future__ import annotations

from .._extras import installed_version, require

require("titan", "cp_dtensor.titan (the torchtitan plugin)")

__all__ = ["FAMILIES", "CPDTensor", "CPTrainer", "apply_ring_attention", "as_cp_config", "check_config",
           "parallelize_with_ring", "train_spec"]

# old module paths (cp_dtensor.titan.spec, ...): cp_dtensor._deprecated.MOVED_MODULES (Note [Old module paths])

VERSION = installed_version("titan")[:2]


def _elsewhere(name: str, why: str):
    def refused(*args, **kwargs):
        raise RuntimeError(f"cp_dtensor.titan.{name} is not available with torchtitan {'.'.join(map(str, VERSION))}: "
                           f"{why}")

    refused.__name__ = refused.__qualname__ = name
    return refused


if VERSION >= (0, 3):  # the config-registry glue
    from .shared.options import CPDTensor
    from .v03 import FAMILIES, CPTrainer, as_cp_config, check_config, install

    _TOML = ("torchtitan 0.3 has no TOML train specs; pick a config with --module cp_dtensor.titan "
             "--config CONFIG (or --module FAMILY with python -m cp_dtensor.titan.train).")
    train_spec = _elsewhere("train_spec", _TOML)
    parallelize_with_ring = _elsewhere("parallelize_with_ring", _TOML)
    apply_ring_attention = _elsewhere("apply_ring_attention", _TOML)
else:  # torchtitan 0.2.x: the TOML glue
    from .shared.cpu import install_triton_stand_in

    install_triton_stand_in()  # before the first `import torchtitan`; see Note [torchtitan on CPU]

    from .shared.options import CPDTensor
    from .v02 import install
    from .v02.config import FAMILIES, check_config
    from .v02.families import apply_ring_attention
    from .v02.spec import parallelize_with_ring, train_spec

    as_cp_config = _elsewhere("as_cp_config", "it turns a torchtitan 0.3 config into the plugin's; with 0.2.2 the "
                              'TOML says custom_config_module = "cp_dtensor.titan.config" and custom_import = '
                              '"cp_dtensor.titan".')

install()


def __getattr__(name: str):
    if name == "CPTrainer":  # 0.2.2's imports torchtitan.train, which `python -m torchtitan.train` runs as __main__
        from .v02.trainer import CPTrainer

        return CPTrainer
    if name == "check_job_config":  # its old name
        from .._deprecated import warn_once

        warn_once("cp_dtensor.titan.check_job_config", "cp_dtensor.titan.check_config")
        return check_config
    raise AttributeError(f"module 'cp_dtensor.titan' has no attribute {name!r}")
