"""Sequence tiling serves what the tiling sweep proves (tests/hf/_tiling_sweep.py, scripts/hf_tiling_sweep.py;
Note [The transformers door's allowlist]). Default tier, cheap: the checked-in list (cp_dtensor/hf/tiled_families.py)
has a verdict for every family the CP door serves, TILED_FAMILIES is its served entries with the rules their runs
proved, docs/transformers.md's table is the one the list generates; the sweep on three families (a divided and two
multiplied logit scales, a router loss, multipliers) gives the list's verdicts; and the sweep refuses what it must
(a soft cap or an unknown scale between the head and the loss, an MLP that mixes tokens); the served families'
forwards, read from their source, do between head and loss only what the door serves. Slow tier: the whole
sweep gives the list."""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from _tiers import slow

transformers = pytest.importorskip("transformers")

import _tiling_sweep as sweep  # noqa: E402

from cp_dtensor.hf import families, served, tiled_families  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "transformers.md")


def _served() -> set[str]:
    return {kind for kind, verdict in tiled_families.VERDICTS.items() if verdict.startswith("served")}


def test_the_list_covers_the_cp_list():
    """A verdict for every family the CP door serves, and only those; swept on the CP list's transformers."""
    assert tiled_families.TRANSFORMERS == families.TRANSFORMERS
    assert set(tiled_families.VERDICTS) == set(sweep.cp_served()), (
        f"families without a tiling verdict: {sorted(set(sweep.cp_served()) - set(tiled_families.VERDICTS))}; "
        f"verdicts of families the CP door no longer serves: {sorted(set(tiled_families.VERDICTS) - set(sweep.cp_served()))}."
        " Run python scripts/hf_tiling_sweep.py")
    for verdict in tiled_families.VERDICTS.values():  # every verdict says served, or why not
        assert verdict.startswith("served") or len(verdict) > 20, verdict


def test_the_door_serves_the_list():
    """TILED_FAMILIES is the served entries: each family's own causal LM class, the config keys its run proved,
    output_router_logits where that run was proven, the logit scale and by-hand rules."""
    names = sweep.families()
    assert set(served.TILED_FAMILIES) == _served() == set(tiled_families.CLASSES)
    assert set(tiled_families.KEYS) | set(tiled_families.ROUTER_LOSS) <= _served()
    for kind, (cls, rules) in served.TILED_FAMILIES.items():
        assert cls == names[kind], kind
        assert rules == served.tiled_rules(kind, tiled_families.KEYS.get(kind, ()), kind in tiled_families.ROUTER_LOSS)
        assert ("output_router_logits" in rules) == (kind in tiled_families.ROUTER_LOSS) or kind in served.TILED_RULES
    assert set(served.LOGIT_SCALES) | set(served.TILED_RULES) <= _served()


def test_the_docs_table_is_current():
    text = open(DOCS).read()
    table = text[text.index(sweep.BEGIN):text.index(sweep.END) + len(sweep.END)]
    assert table == sweep.render_table(tiled_families.VERDICTS, tiled_families.KEYS, tiled_families.TRANSFORMERS), \
        "docs/transformers.md's tiling table is not the list's: run python scripts/hf_tiling_sweep.py --table"


def test_the_list_file_is_what_the_sweep_writes():
    path = os.path.join(os.path.dirname(tiled_families.__file__), "tiled_families.py")
    t = tiled_families
    assert open(path).read() == sweep.render_list(t.VERDICTS, t.CLASSES, t.KEYS, t.ROUTER_LOSS, t.TRANSFORMERS)


FEW = ("cohere2", "granitemoe", "hyperclovax")  # model.logit_scale; logits / config scale + router loss; logits * it


def test_the_sweep_on_three_families():
    """The sweep itself in the default tier, for the families whose logits the door scales (Granite-MoE with its
    router loss and multipliers too): their verdicts, keys and router loss as the list has them."""
    verdicts, classes, keys, routers = sweep.sweep(only=list(FEW))
    assert verdicts == {k: tiled_families.VERDICTS[k] for k in FEW}
    assert keys == {k: tiled_families.KEYS[k] for k in FEW if k in tiled_families.KEYS}
    assert routers == set(FEW) & tiled_families.ROUTER_LOSS == {"granitemoe"}


def test_the_sweep_refuses_what_touches_the_logits(monkeypatch):
    """The sweep can fail: a soft cap between Gemma 2's head and its loss is refused by the door's key rule and,
    with the rule lifted, by the tiled loss itself; Granite-MoE's scale unknown to the door is refused by the
    tiled loss; an MLP that mixes tokens (which tiling would split) changes the loss."""
    cap = dict(final_logit_softcapping=30.0)
    got, _ = sweep.compare("gemma2", "Gemma2ForCausalLM", config=cap)
    assert got.startswith("refused at the door") and "final_logit_softcapping=30.0" in got, got
    lifted = {**served.tiled_rules("gemma2"), "final_logit_softcapping": served._ANY}
    got, _ = sweep.compare("gemma2", "Gemma2ForCausalLM", config=cap, rules=lifted)
    assert got.startswith("tiled: ValueError") and "a tensor other than the LM head's output" in got, got
    assert sweep.compare("gemma2", "Gemma2ForCausalLM")[0] == "served"  # the same run without the cap

    monkeypatch.delitem(served.LOGIT_SCALES, "granitemoe")
    got, keys = sweep.compare("granitemoe", "GraniteMoeForCausalLM")
    assert "logits_scaling" in keys and "a tensor other than the LM head's output" in got, got

    from transformers.models.llama import modeling_llama

    mlp = modeling_llama.LlamaMLP.forward  # an MLP that mixes tokens: tiles change what each token sees
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: mlp(self, x) + x.cumsum(1) / x.shape[1])
    got, _ = sweep.compare("llama", "LlamaForCausalLM")
    assert got.startswith("tiled: the loss") and "differs from the untiled" in got, got


@slow("the whole tiling sweep: every family the CP door serves, tiled against untiled (~15-25 s on one core, ~7 s more to import their modeling code)")
def test_the_sweep_proves_the_list():
    verdicts, classes, keys, routers = sweep.sweep()
    assert verdicts == tiled_families.VERDICTS
    assert (classes, keys, routers) == (tiled_families.CLASSES, tiled_families.KEYS, tiled_families.ROUTER_LOSS)


# newly tiled families with what the sweep proved in them: a multiplied scale read from the model and sliding
# windows, a multiplied config scale and multipliers, a divided one on an MoE, linear attention + MoE, MLA
UNDER_CP = ("cohere2", "hyperclovax", "granitemoeshared", "qwen3_next", "deepseek_v3")


def _cp_tiled_ranks(rank: int, world: int, kinds: list[str]) -> dict[str, str]:
    """The sweep's check through the CP door: ``apply_context_parallel(sequence_tiling=TILE)`` at CP=world
    (headtail) against the untiled model at CP=1 -- the tiled path a CP run takes. 'served' or what differs."""
    from torch.distributed.device_mesh import init_device_mesh

    import cp_dtensor
    from cp_dtensor.doors import reduce_gradients
    from cp_dtensor.hf import attention as hf
    from cp_dtensor.hf.attention import shift_labels

    mesh, names, out = init_device_mesh("cpu", (world,)), sweep.families(), {}
    tokens, positions, labels = sweep._batch()
    shifted = shift_labels(labels)
    count = (shifted != -100).sum()
    for kind in kinds:
        plain, _ = sweep.build(kind, names[kind])
        model = copy.deepcopy(plain)
        ref = sweep._run(plain, cp_labels=False)
        hf.apply_context_parallel(model, mesh, layout="headtail", sequence_tiling=sweep.TILE)
        tok, pos, lab = cp_dtensor.shard_batch((tokens, positions, shifted), mesh, layout="headtail")
        res = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                    use_cache=False)
        res.loss.backward()
        if res.logits.shape[-1] != 0:  # a tiled call returns [B, S_local, 0] logits
            out[kind] = f"CP={world}: the head was not tiled (logits {tuple(res.logits.shape)})"
            continue
        reduce_gradients(model, mesh)
        loss = res.loss.detach().clone()
        torch.distributed.all_reduce(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        linear = any("linear_attention" in (getattr(c, "layer_types", None) or ())
                     for c in sweep._all_configs(plain.config))
        tol = sweep.LINEAR_TOL if linear else sweep.TOL
        out[kind] = sweep._differs(ref, (loss.item(), None, grads), f"CP={world} tiled", tol) or "served"
    return out


def test_tiled_under_cp2_equals_untiled_cp1():
    """The sweep's path is the CP door's: with apply_context_parallel(sequence_tiling=5) at CP=2, these families'
    loss and every gradient equal the untiled model's at CP=1 (the sweep's bars)."""
    from _dist import run_ranks

    got = run_ranks(2, _cp_tiled_ranks, list(UNDER_CP), timeout=300)
    assert got == [{kind: "served" for kind in UNDER_CP}] * 2, got


def _between_head_and_loss(cls) -> list[str]:
    """What the family's forward does to the logits after the head and before ``self.loss_function(``, read from
    its source: the first ``logits = self.<head>(...)`` line past the call's closing parenthesis, then each
    line up to the loss that names the logits."""
    import inspect

    lines = inspect.getsource(cls.forward).splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("logits = self."))
    loss = next(i for i, line in enumerate(lines) if "self.loss_function(" in line)
    assert head < loss, cls
    text = lines[head].split("#")[0].strip()[len("logits = "):]
    depths = itertools.accumulate({"(": 1, ")": -1}.get(char, 0) for char in text)
    end = next(i for i, (char, depth) in enumerate(zip(text, depths)) if char == ")" and depth == 0)  # the call's
    after = text[end + 1:].strip()
    return [f"logits {after}"] * bool(after) + [line.split("#")[0].strip() for line in lines[head + 1:loss]
                                                if "logits" in line]


def test_the_forwards_read_agree_with_the_list():
    """An independent reference for the sweep's verdicts: every served family's forward, read from its source,
    calls the head once and the loss after it, and what it does to the logits in between is a scale the door
    applies with the same operation and key (LOGIT_SCALES: which a head without a bias does not show in the loss)
    or a soft cap whose key the door serves only as None."""
    names = sweep.families()
    read = {}
    for kind in served.TILED_FAMILIES:
        steps = _between_head_and_loss(getattr(transformers, names[kind]))
        if steps:
            read[kind] = steps
    for kind, steps in read.items():
        rules = served.TILED_FAMILIES[kind][1]
        if any("tanh" in step for step in steps):  # a soft cap: served only while its key is None
            key = "final_logit_softcapping"
            assert all(key in step for step in steps if "tanh" not in step), (kind, steps)
            assert rules.get(key) in (None, (None,)), (kind, rules.get(key))
        else:  # a scale: `logits <op> <where>.<key>`, the door's entry the same
            key, op, where = served.LOGIT_SCALES[kind]
            src = "self.config." if where == "config" else "self."
            assert steps == [f"logits = logits {op} {src}{key}"] or steps == [f"logits {op} {src}{key}"], (kind, steps)
    assert set(served.LOGIT_SCALES) <= set(read)
    assert len(read) == 15, sorted(read)  # 5 Granite, HyperCLOVA X, 3 Cohere, 6 soft caps (Gemma 2 / 3 / 4, ...)
