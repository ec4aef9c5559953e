"""What both torchtitan versions' glue uses: the ``cp_dtensor`` options (options.py), running torchtitan
on CPU ranks (cpu.py), the shipped dataset (data.py), float8 linears on CPU (float8.py), TP heads and the
Ulysses mesh (heads.py). Nothing here imports torchtitan at import time except where it says so."""
