"""The core: context parallel attention on plain local shards, with torch alone.

Bottom to top: ``layout`` (which global positions a rank holds), ``masks`` (the mask plan: which
rectangles of each ring step run), ``wire`` and ``payload`` (bytes on the wire, float8 payloads),
``kernels`` and ``ops`` (the SDPA kernels as custom ops: the compile boundary), ``comm`` (the only
module on the network), ``checks`` and ``agreement`` (every rank agrees before any K/V moves),
``blocks`` (one step against one K/V block), ``ring`` / ``allgather`` / ``ulysses`` (the exchanges),
``attention`` (the front door ``ring_attention``), ``decode`` (attention against a sequence-sharded
KV cache), ``linear_attention`` / ``linear_conv`` (state passing for linear-attention layers, over
``linear_runs``), ``batch`` (a batch's share on each rank). Importing this package imports nothing.
"""
