"""The transformers door serves what the conformance sweep proves (tests/hf/_conformance.py,
scripts/hf_conformance.py; Note [The transformers door's allowlist]). Default tier, cheap: the checked-in list
(cp_dtensor/hf/families.py) has a verdict for every causal LM family of the installed transformers, the door's
allowlist is exactly its served entries, and docs/transformers.md's table is the one the list generates. Slow
tier: the sweep itself, at CP=2 and CP=3, gives the list's verdicts."""

from __future__ import annotations

import os

import pytest
from _tiers import exhaustive, slow

transformers = pytest.importorskip("transformers")

from cp_dtensor.hf import families, served  # noqa: E402
import _conformance as conformance  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "transformers.md")
# the families this change set out to serve, by name: each must be in the list as served
NAMED = ("deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen2_moe", "ernie4_5_moe", "dots1", "olmo3",
         "smollm3", "seed_oss", "apertus")


def _served() -> set[str]:
    return {kind for kind, verdict in families.VERDICTS.items() if verdict.startswith("served")}


def test_the_list_covers_the_installed_transformers():
    """Every causal LM family of the installed transformers has a verdict (a new one fails here, by name, until
    the sweep has run on it); the list was swept on this version."""
    installed = set(conformance.families())
    if transformers.__version__ != families.TRANSFORMERS:
        pytest.skip(f"the list is transformers {families.TRANSFORMERS}'s, this is {transformers.__version__}: new "
                    f"families {sorted(installed - set(families.VERDICTS))}; run python scripts/hf_conformance.py")
    assert installed == set(families.VERDICTS), (
        f"families without a verdict: {sorted(installed - set(families.VERDICTS))}; verdicts of families transformers "
        f"no longer has: {sorted(set(families.VERDICTS) - installed)}. Run python scripts/hf_conformance.py")


def test_the_door_serves_the_list():
    """The allowlist is the list's served entries (at least 40 text decoders, every named family among them), and
    every sub-config of a served family is served too (so a served model passes the door's model_type check)."""
    assert served.CP_FAMILIES == _served()
    assert len(_served()) >= 40 and set(NAMED) <= _served(), sorted(set(NAMED) - _served())
    for kind in _served():
        config = transformers.CONFIG_MAPPING[kind]()
        kinds = {c.model_type for c in conformance._all_configs(config)}
        assert kinds <= served.CP_FAMILIES, (kind, kinds - served.CP_FAMILIES)
    for verdict in families.VERDICTS.values():  # every verdict says served, or why not
        assert verdict.startswith("served") or len(verdict) > 20, verdict


def test_the_docs_table_is_current():
    text = open(DOCS).read()
    table = text[text.index(conformance.BEGIN):text.index(conformance.END) + len(conformance.END)]
    assert table == conformance.render_table(families.VERDICTS, families.TRANSFORMERS), \
        "docs/transformers.md's table is not the list's: run python scripts/hf_conformance.py --table"


def test_the_list_file_is_what_the_sweep_writes():
    path = os.path.join(os.path.dirname(families.__file__), "families.py")
    assert open(path).read() == conformance.render_list(families.VERDICTS, families.TRANSFORMERS)


def test_mla_and_moe_families_at_cp2():
    """The sweep's check in the default tier for two of the list's families: DeepSeek-V3 (MLA: value heads of 8
    under query / key heads of 12, a shared expert) and GLM-4.5 (glm4_moe) at CP=2 equal CP=1."""
    assert conformance.sweep((2,), only=["deepseek_v3", "glm4_moe"]) == {"deepseek_v3": "served", "glm4_moe": "served"}


@pytest.mark.parametrize("worlds", [
    pytest.param((3,), marks=slow("the conformance sweep at CP=3 (uneven shards: ~3 min on 2 cores)"), id="cp3"),
    pytest.param((2, 3), marks=exhaustive("the whole conformance sweep, CP=2 and CP=3 (~6 min on 2 cores)"),
                 id="cp2_cp3"),
])
def test_the_sweep_proves_the_list(worlds):
    """Each family's verdict from a fresh sweep: served exactly where the list says served (the reasons of the
    others may word a number differently). CI runs CP=3 (the default tier runs two families at CP=2); the whole
    sweep, both sizes, is what wrote the list."""
    got = conformance.with_notes(conformance.sweep(worlds))
    assert {k for k, v in got.items() if v.startswith("served")} == _served()
    assert got.keys() == families.VERDICTS.keys()
