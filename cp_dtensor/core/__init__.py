"""The core: context parallel attention on plain local shards, with torch alone.

Four subpackages, bottom to top, and the front door above them:

* ``plan``: which global positions a rank holds (``layout``), the mask plan (``masks``), bytes on the wire
  (``wire``), document placement (``doc_plan``, ``documents``), a ring call's options (``spec``); torch-free
  but ``spec``.
* ``compute``: one rank's work -- the SDPA kernels (``kernels``), the same as custom ops, the compile boundary
  (``ops``, ``varlen``), ``ordering`` (after / tie), one step against one K/V block (``blocks``).
* ``exchange``: the network -- ``comm`` (the only module that calls collectives), ``payload`` (float8 and cast
  payloads), the exchanges ``ring`` / ``allgather`` / ``ulysses``, the document exchange (``doc_exchange`` ->
  ``doc_blocks``; ``doc_op`` its compile boundary).
* ``linear``: state passing for linear-attention layers (``linear_attention``, ``linear_conv`` over
  ``linear_plan``, ``linear_runs``, ``linear_steps``).

At this level: ``checks`` and ``agreement`` (every rank agrees before any K/V moves), ``attention`` (the front
door ``ring_attention``), ``batch`` (a batch's share on each rank), ``decode`` (attention against a
sequence-sharded KV cache), ``tiling`` (the LM head and MLP in sequence tiles). Old paths
(``cp_dtensor.core.ring``, ...) still import, warning once (Note [Old module paths] in ``_deprecated.py``).
Importing this package imports nothing.
"""
