"""core/agreement.py's decisions, on one process (Note [One agreement]): the errors every rank raises,
written out by hand; the entry points' multi-rank agreements are tested with their entry points
(test_ring, test_compile_checks, test_decode, test_linear_attention, tests/hf)."""

from __future__ import annotations

import pytest
import torch

from cp_dtensor.core.agreement import SAME_SHARDS, Rules, agree, agree_objects

RULES = Rules("op", ("batch", "layout"), describe=lambda f, v: repr(("x", "y")[v]) if f == "layout" else v)


def test_refused_names_every_failing_rank_and_the_first_error():
    with pytest.raises(ValueError) as e:
        RULES.raise_refused([None, "bad q on 1", None, "bad q on 3"])
    assert str(e.value) == "op rejected the inputs of rank(s) 1, 3: bad q on 1"
    listed = Rules("generate()", (), refused="{what} refused the call on rank(s) {rank_list}: {error}")
    with pytest.raises(ValueError, match=r"^generate\(\) refused the call on rank\(s\) \[0\]: no$"):
        listed.raise_refused(["no", None])
    RULES.raise_refused([None, None])  # nobody failed: nothing raised


def test_differ_tables_only_the_fields_that_differ():
    with pytest.raises(ValueError) as e:
        RULES.raise_differ([(2, 0), (2, 1), (2, 1)])
    assert str(e.value) == ("op needs the same layout on every rank of the CP group; got rank 0: layout='x'; "
                            f"rank 1: layout='y'; rank 2: layout='y'. {SAME_SHARDS}")
    RULES.raise_differ([(2, 1), (2, 1)])  # all equal: nothing raised


def test_one_rank_raises_its_own_error_and_returns_its_fingerprint():
    with pytest.raises(ValueError, match="^bad here$"):
        agree(RULES, [-1, -1], "bad here", None)
    assert agree(RULES, [2, 1], None, None).tolist() == [[2, 1]]
    assert agree(Rules("op", ("a",), digest=True), [3], None, None) is None
    with pytest.raises(ValueError, match="^bad here$"):
        agree_objects(RULES, (), "bad here", None)
    assert agree_objects(RULES, (2, "x"), None, None, extra="mine") == ["mine"]
    assert agree(RULES, [2, 1, 7], None, None).dtype == torch.int64  # a free value rides along
