"""Which torchtitan jobs under ``[compile] enable`` the plugin runs, and the refusal of the rest.

Note [Tensor parallelism under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan compiles each transformer block (and the loss); under tensor parallelism the blocks hold
DTensor parameters and move DTensor activations, which torch.compile traces through AOTAutograd. On
CPU ranks (gloo) with the torch this project pins, that trace does not give the eager gradients:

* llama3 debugmodel, CP = 2 x TP = 2, fp32, from one seed checkpoint: losses 8.17354 / 8.01085 /
  7.55665 against eager's 8.17354 / 8.00845 / 7.55022 (grad_norm 1.4671 vs 1.4694); the inductor and
  aot_eager backends give the same wrong numbers, so the code generator is not the cause. Other
  jobs stop with "Could not resolve the process group registered under the name ..." (fp32, qwen3).
* TP = 2 at CP = 1 -- where the plugin changes nothing in the model -- stops in DTensor's redistribute
  backward ("'Tensor' object has no attribute '_local_tensor'"): a plain tensor reaches a backward
  that expects a DTensor gradient.
* With ``--compile.backend eager`` (Dynamo only, no AOTAutograd) both jobs log the eager losses.

* torchtitan 0.3 on torch 2.15 (its own TP plan, the same ring): llama3 TP = 2 and CP = 2 x TP = 2
  compiled (inductor) log the CP = 1 eager losses 8.17432 / 7.90685 / 7.79355, so 0.3's check does not
  refuse them.

So the cause is AOTAutograd's handling of DTensor gradients, under torch 2.13 with torchtitan 0.2.2's TP
plan (which of the two changed by 0.3 on 2.15 is not pinned down), not the ring. Since a silent wrong
gradient is the one failure a user cannot see, the 0.2.2 plugin refuses TP > 1 with compile at start, on
every rank, unless the backend is "eager": on CPU at every CP degree, and with CP > 1 on any device
(the ring under TP and AOTAutograd is not proven exact there either). A GPU job at CP = 1 is
torchtitan's own and left alone.
"""

from __future__ import annotations

__all__ = ["tp_compile_clash"]


def tp_compile_clash(*, cp: int, tp: int, compile_enabled: bool, backend: str, accelerator: bool) -> str | None:
    """Why this job's TP x compile is refused (Note [Tensor parallelism under torch.compile]); None if it runs."""
    if tp == 1 or not compile_enabled or backend == "eager" or (accelerator and cp == 1):
        return None
    where = "on CPU ranks" if not accelerator else "with cp_dtensor context parallelism"
    return (f"[compile] enable with tensor_parallel_degree = {tp} (context_parallel_degree = {cp}) {where}: "
            f'torch.compile\'s AOTAutograd (backend "{backend}"; inductor and aot_eager alike) trains these DTensor '
            "models on wrong gradients or stops in DTensor's redistribute backward (Note [Tensor parallelism under "
            "torch.compile]). Turn compile off, set tensor_parallel_degree = 1, or pass --compile.backend eager "
            "(Dynamo without AOTAutograd: the eager gradients)")
