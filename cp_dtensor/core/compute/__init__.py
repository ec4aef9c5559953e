"""The local compute: the SDPA kernels (``kernels``), the same as custom ops -- the compile boundary -- with their
varlen pieces (``ops``, ``varlen``), the order ties between ops (``ordering``) and one step against one K/V block
(``blocks``). Calls down into ``plan`` only. Importing this package imports nothing.
"""
