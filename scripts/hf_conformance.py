"""The transformers door's conformance sweep: every ``...ForCausalLM`` family of the installed transformers as a
tiny random fp32 model, at CP=2 and CP=3 against CP=1 (loss, logits, every gradient, one greedy generate()),
on forked CPU ranks (tests/hf/_conformance.py). Writes what it proves to cp_dtensor/hf/families.py (the door's
allowlist) and the table of docs/transformers.md.

    python scripts/hf_conformance.py            # sweep (~5 min on 2 cores), write the list and the table
    python scripts/hf_conformance.py --table    # the table again from the checked-in list (no sweep)
    python scripts/hf_conformance.py --new      # families of the installed transformers the list has no verdict for
    python scripts/hf_conformance.py --only deepseek_v3,glm4_moe   # sweep these, print, write nothing
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "hf")]

import torch  # noqa: E402

import _conformance as conformance  # noqa: E402

LIST = os.path.join(ROOT, "cp_dtensor", "hf", "families.py")
DOCS = os.path.join(ROOT, "docs", "transformers.md")


def write_table(verdicts: dict[str, str], version: str) -> None:
    text = open(DOCS).read()
    head, rest = text.split(conformance.BEGIN)
    tail = rest.split(conformance.END)[1]
    text = head + conformance.render_table(verdicts, version) + tail  # rendered before the file is opened
    with open(DOCS, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="rewrite the docs table from the checked-in list")
    parser.add_argument("--new", action="store_true", help="list the families the checked-in list lacks")
    parser.add_argument("--only", default=None, help="comma-separated model_types: sweep these and print only")
    args = parser.parse_args()
    import transformers

    if args.table or args.new:
        from cp_dtensor.hf import families
    if args.table:
        write_table(families.VERDICTS, families.TRANSFORMERS)
        return
    if args.new:
        new = sorted(set(conformance.families()) - set(families.VERDICTS))
        gone = sorted(set(families.VERDICTS) - set(conformance.families()))
        print(f"transformers {transformers.__version__} (the list: {families.TRANSFORMERS}): "
              f"{len(new)} new families {new}; {len(gone)} gone {gone}")
        return
    torch.set_num_threads(1)
    only = args.only.split(",") if args.only else None
    verdicts = conformance.with_notes(conformance.sweep((2, 3), only))
    for kind, verdict in verdicts.items():
        print(f"{kind:28s} {verdict}")
    print(f"served: {sum(v.startswith('served') for v in verdicts.values())} of {len(verdicts)}")
    if only is None:
        with open(LIST, "w") as f:
            f.write(conformance.render_list(verdicts, transformers.__version__))
        write_table(verdicts, transformers.__version__)


if __name__ == "__main__":
    main()
