"""The tiling sweep of the transformers door: every family the CP door serves (cp_dtensor/hf/families.py) as a
tiny random fp32 model, sequence-tiled against untiled (loss, every gradient, the router loss where the family
has one), in this process (tests/hf/_tiling_sweep.py). Writes what it proves to cp_dtensor/hf/tiled_families.py
(the tiling door's allowlist) and the tiling table of docs/transformers.md.

    python scripts/hf_tiling_sweep.py            # sweep (~30-40 s on one core), write the list and the table
    python scripts/hf_tiling_sweep.py --table    # the table again from the checked-in list (no sweep)
    python scripts/hf_tiling_sweep.py --only granitemoe,cohere2   # sweep these, print, write nothing
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "hf")]

import _tiling_sweep as sweep  # noqa: E402

LIST = os.path.join(ROOT, "cp_dtensor", "hf", "tiled_families.py")
DOCS = os.path.join(ROOT, "docs", "transformers.md")


def write_table(verdicts: dict[str, str], keys: dict[str, tuple], version: str) -> None:
    text = open(DOCS).read()
    head, rest = text.split(sweep.BEGIN)
    tail = rest.split(sweep.END)[1]
    text = head + sweep.render_table(verdicts, keys, version) + tail  # rendered before the file is opened
    with open(DOCS, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="rewrite the docs table from the checked-in list")
    parser.add_argument("--only", default=None, help="comma-separated model_types: sweep these and print only")
    args = parser.parse_args()
    import transformers

    if args.table:
        from cp_dtensor.hf import tiled_families

        write_table(tiled_families.VERDICTS, tiled_families.KEYS, tiled_families.TRANSFORMERS)
        return
    only = args.only.split(",") if args.only else None
    verdicts, classes, keys, routers = sweep.sweep(only)
    for kind, verdict in verdicts.items():
        print(f"{kind:28s} {verdict}")
    print(f"served: {sum(v.startswith('served') for v in verdicts.values())} of {len(verdicts)}")
    if only is None:
        with open(LIST, "w") as f:
            f.write(sweep.render_list(verdicts, classes, keys, routers, transformers.__version__))
        write_table(verdicts, keys, transformers.__version__)


if __name__ == "__main__":
    main()
