"""The ``[cp_dtensor]`` TOML section for torchtitan 0.2.2: a job's TOML names this module as
``[job] custom_config_module = "cp_dtensor.titan.config"`` and torchtitan merges its ``JobConfig`` into
its own. The section's fields are ``CPDTensor``'s (shared/options.py); the checks live in v02/config.py.
"""

from .v02.config import COMM_DTYPES, FAMILIES, CPDTensor, JobConfig, check_config, cp_section

__all__ = ["COMM_DTYPES", "FAMILIES", "CPDTensor", "JobConfig", "check_config", "cp_section"]
