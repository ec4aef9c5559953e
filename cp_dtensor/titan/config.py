"""The ``[cp_dtensor]`` TOML section for torchtitan 0.2.2: a job's TOML names this module as
``[job] custom_config_module = "cp_dtensor.titan.config"`` and torchtitan merges its ``JobConfig`` into
its own. The section's fields are ``CPDTensor``'s (shared/options.py); the checks live in v02/config.py.
"""

from .v02.config import COMM_DTYPES, FAMILIES, CPDTensor, JobConfig, check_config, cp_section

__all__ = ["COMM_DTYPES", "FAMILIES", "CPDTensor", "JobConfig", "check_config", "cp_section"]


def __getattr__(name: str):
    if name == "check_job_config":  # its old name
        from .._deprecated import warn_once

        warn_once("cp_dtensor.titan.config.check_job_config", "cp_dtensor.titan.check_config")
        return check_config
    raise AttributeError(f"module 'cp_dtensor.titan.config' has no attribute {name!r}")
