"""scripts/examples/pipeline_cp.py (docs/own_model.md, "Pipeline stages"): torch.distributed.pipelining stages
whose attention runs the ring on a 2-D ("pp", "cp") mesh. The script checks itself against the same model on
one process (the loss and every gradient); here it runs on 4 forked gloo ranks."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from _dist import run_ranks

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "examples" / "pipeline_cp.py"


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_cp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rank: int, world: int) -> list[dict[str, float]]:
    return [_example().main(n_microbatches=4, layout="headtail")]  # the script's default: 2, striped


def test_pipeline_stages_with_ring_match_one_process():
    results = run_ranks(4, _run)
    for rank, per_rank in enumerate(results):
        for got in per_rank:
            if rank >= 2:  # the last stage's ranks: its loss summed over CP equals one process's
                assert got["loss"] == pytest.approx(got["want"], rel=1e-5)
            assert got["worst_grad_diff"] < 1e-5  # asserted per parameter inside the script too


def test_docs_show_the_example():
    page = (SCRIPT.parents[2] / "docs" / "own_model.md").read_text()
    script = {line.strip() for line in SCRIPT.read_text().splitlines()}
    block = page.split("## Pipeline stages", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    missing = [line for line in block.splitlines() if line.strip() and line.strip() not in script]
    assert not missing, f"docs/own_model.md lines not in scripts/examples/pipeline_cp.py: {missing}"
