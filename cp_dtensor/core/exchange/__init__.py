"""The exchanges: the only modules on the network (``comm``), K/V payloads (``payload``), the ring (``ring``), the
all-gather (``allgather``), the heads all-to-all (``ulysses``) and the document exchange (``doc_exchange`` ->
``doc_blocks``; ``doc_op`` its compile boundary). Calls down into ``compute`` and ``plan``. Importing this package
imports nothing.
"""
