"""A documents plan checked against the positions each door sees (``DocumentLayout.positions_error``, Note [A plan
fits its batch]): a plan of another batch whose documents are coarser, finer or shifted against this batch's
positions, another rank's positions, and a batch sharded with a layout name but given a documents plan, raise on
every rank before any K/V moves -- at the own-model door and the transformers door -- even when only one rank's
tokens show it; the plan of the batch itself runs, and a plan of the same documents serves a batch of other
tokens as CP=1 does. P = 2."""

from __future__ import annotations

import copy

import pytest
import torch
from test_documents_doors import TinyLM, _batch
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from cp_dtensor import hf  # noqa: E402

N, V = 24, 32


def _raises_everywhere(where, fn, match):
    with CommBytes() as sent, pytest.raises(ValueError, match=match):
        fn()
    assert sent.sent == sent.by_op.get("all_gather_into_tensor", 0), (where, dict(sent.by_op))  # agreement only


def _cases(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    tokens, other = torch.randint(0, V, (2, 2, N))  # two batches of the same documents, other tokens
    positions, ids = _batch([[5, 1, 11, 7], [14, 10]])  # restart at 0: this batch's documents
    arange = torch.arange(N).expand(2, N)  # one document a row
    jumped = arange.clone()
    jumped[:, 17:] += 40  # positions that jump without restarting at 0
    one = torch.zeros(2, N, dtype=torch.int64)  # one document a row: a plan coarser than the batch
    plans = {
        "coarser, positions restart elsewhere": (jumped, cp_dtensor.document_layout(one, world)),
        "coarser, positions restart at 0": (positions, cp_dtensor.document_layout(one, world)),
        # the plan of a packed batch given with one document a row (positions 0..N-1): finer than the batch
        "finer": (arange, cp_dtensor.document_layout(ids, world)),
        "finer, positions jump": (jumped, cp_dtensor.document_layout((jumped != arange).long(), world)),
        "shifted by one token": (positions, cp_dtensor.document_layout(_batch([[6, 1, 10, 7], [15, 9]])[1], world)),
        "shifted, same documents' count": (positions, cp_dtensor.document_layout(_batch([[4, 2, 11, 7], [13, 11]])[1],
                                                                                  world)),
    }
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")).float()
    doors = {
        "model door": (cp_dtensor.apply_context_parallel(TinyLM(vocab=V), mesh, layout="documents"),
                       lambda m, tok, pos, plan: m(tok, positions=pos, cp_layout=plan)),
        "hf door": (hf.apply_context_parallel(copy.deepcopy(llama), mesh, layout="documents"),
                    lambda m, tok, pos, plan: m(input_ids=tok, position_ids=pos, cp_layout=plan, use_cache=False).logits),
    }
    done = []
    for door, (model, call) in doors.items():
        for case, (pos, plan) in plans.items():
            tok, p = cp_dtensor.shard_batch((tokens, pos), mesh, layout=plan)
            _raises_everywhere(f"{door}: {case}", lambda: call(model, tok, p, plan), "plan")
            done.append(f"{door}: {case}")
        own = cp_dtensor.document_layout(ids, world)
        # another rank's positions on this rank (its tokens the right ones): the positions a rank was not given
        tok, p = cp_dtensor.shard_batch((tokens, positions), mesh, layout=own)
        theirs = cp_dtensor.shard_tensor(positions, seq_dim=1, layout=own, rank=(rank + 1) % world, cp_size=world)
        _raises_everywhere(f"{door}: other rank's positions", lambda: call(model, tok, theirs, own), "plan")
        done.append(f"{door}: other rank's positions")
        # the batch sharded with a layout name, called with a documents plan (its own ids)
        plan = cp_dtensor.document_layout(one, world)
        tok, p = cp_dtensor.shard_batch((tokens, arange), mesh, layout="striped")
        _raises_everywhere(f"{door}: named shard", lambda: call(model, tok, p, plan), "sharded in another order")
        done.append(f"{door}: named shard")
        for pos, plan in ((arange, cp_dtensor.document_layout(one, world)), (positions, own)):  # its own plan runs
            tok, p = cp_dtensor.shard_batch((tokens, pos), mesh, layout=plan)
            call(model, tok, p, plan)
    # a plan that fits (built from batch A) serves batch B of the same documents, other tokens: CP=1's logits
    model, call = doors["hf door"]
    own = cp_dtensor.document_layout(ids, world)
    tok, p = cp_dtensor.shard_batch((other, positions), mesh, layout=own)
    got = cp_dtensor.unshard_batch(call(model, tok, p, own).detach(), mesh, layout=own)
    with torch.no_grad():
        want = llama(input_ids=other, position_ids=positions, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    return done


def test_plans_checked_against_positions_on_every_rank():
    results = run_ranks(2, _cases)
    assert results[0] == results[1] and len(results[0]) == 16


def test_document_layout_cp_size_and_world_alias():
    """``DocumentLayout.cp_size`` is the CP degree (the one vocabulary); ``world`` its deprecated alias, warning
    once."""
    import warnings

    from cp_dtensor import _deprecated

    plan = cp_dtensor.document_layout(_batch([[5, 1, 11, 7], [14, 10]])[1], 3)
    assert plan.cp_size == 3 and plan.s_local == N // 3 and "cp_size=3" in repr(plan)
    _deprecated._warned.discard("DocumentLayout.world")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plan.world == 3 and plan.world == 3
    assert [str(c.message) for c in caught if issubclass(c.category, FutureWarning)] == [
        "DocumentLayout.world is deprecated and will be removed in a future release; use DocumentLayout.cp_size."]
