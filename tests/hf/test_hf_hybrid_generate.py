"""generate() of hybrid linear-attention transformers models under CP (cp_dtensor/hf/generate.py + linear.py):
Qwen3-Next, Qwen3.5 (text, dense and MoE) and Kimi Linear (KDA + MLA, Dqk != Dv) from tiny configs, against
the same model at CP=1 in the same process: greedy tokens equal, every step's logits within 1e-4 (fp32), the
linear layers' recurrent and conv states within 1e-5 (after the prompt and after decoding), each rank's
attention-layer cache about 1/P of the tokens; P = 2 and 3, headtail and contiguous, left padding, prompts
shorter than P and than the conv kernel, EOS per row, max_length, seeded sampling, inference_mode; what
cannot be served raises on every rank before the first token, and the cache's methods are right or refused
on every rank."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _tiers import slow
from test_hf_generate import _compare, _generate, _prompt  # one prompt, generate and comparison for both files
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_hf_linear import COMMON, TYPES  # noqa: E402
from test_hf_linear import _model as _hybrid  # noqa: E402  the tiny hybrids (4 layers: linear, linear, full, linear)
from transformers.cache_utils import LinearAttentionCacheLayerMixin  # noqa: E402
from transformers.models.bailing_hybrid import BailingHybridConfig, BailingHybridForCausalLM  # noqa: E402
from transformers.models.lara_mini import LaraMiniConfig, LaraMiniForCausalLM  # noqa: E402
from transformers.models.olmo_hybrid import OlmoHybridConfig, OlmoHybridForCausalLM  # noqa: E402

from cp_dtensor.core.plan.layout import layout_unit  # noqa: E402
from cp_dtensor.hf import ReplicatedLinearLayer, ShardedCache, ShardedCacheLayer, apply_context_parallel  # noqa: E402

TOL = 1e-4  # fp32 logits, relative to the largest magnitude (the bound)
STATE_TOL = 1e-5  # the linear layers' states
V = 128  # test_hf_linear's vocabulary
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
OTHERS = {  # the same linear layers in other transformers models (hf_linear.FAMILIES), with their defaults' init
    "olmo_hybrid": (OlmoHybridConfig, OlmoHybridForCausalLM, LINEAR),  # GDN with negative eigenvalues
    "lara_mini": (LaraMiniConfig, LaraMiniForCausalLM, dict(  # GDN, MoE
        LINEAR, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "bailing_hybrid": (BailingHybridConfig, BailingHybridForCausalLM, dict(  # KDA + MLA, dense MLPs
        num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        head_dim=16, first_k_dense_replace=4, num_mtp_layers=0, moe_intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1)),
}


def _model(name: str):
    if name not in OTHERS:
        return _hybrid(name)
    cfg_cls, cls, extra = OTHERS[name]
    torch.manual_seed(0)
    common = {k: v for k, v in COMMON.items() if k != "max_position_embeddings"}
    return cls(cfg_cls(**{**common, **extra, "layer_types": TYPES, "pad_token_id": 0})).float()

CASES = [  # (model, layout, batch, prompt length -- not a multiple of 2P --, left padding per row, max_new_tokens)
    ("qwen3_next", "headtail", 2, 13, [0, 4], 5),
    ("qwen3_next", "contiguous", 1, 11, None, 4),
    ("qwen3_5", "headtail", 1, 9, None, 4),
    ("qwen3_5", "contiguous", 2, 7, [2, 0], 4),
    ("kimi_linear", "headtail", 2, 10, [3, 0], 5),
    ("kimi_linear", "contiguous", 1, 5, None, 4),
    ("qwen3_5_moe", "headtail", 1, 8, None, 3),
    ("qwen3_next", "headtail", 1, 1, None, 3),  # a one-token prompt: shorter than P and than the conv kernel
    ("olmo_hybrid", "headtail", 2, 11, [0, 3], 3),
    ("lara_mini", "contiguous", 1, 9, None, 3),
    ("bailing_hybrid", "headtail", 2, 7, [1, 0], 3),
]


def _every(x, world: int) -> list:
    every = [None] * world
    torch.distributed.all_gather_object(every, x)
    return every


def _compare_states(cache, ref_cache, world: int, where: str) -> int:
    """The linear layers' states against CP=1's (and the same bits on every rank); returns how many layers."""
    n = 0
    for i, (layer, ref) in enumerate(zip(cache.layers, ref_cache.layers)):
        if not isinstance(ref, LinearAttentionCacheLayerMixin):
            continue
        assert isinstance(layer, ReplicatedLinearLayer), (where, i, type(layer))
        for what, got, want in (("recurrent", layer.recurrent_states[0], ref.recurrent_states[0]),
                                ("conv", layer.conv_states[0], ref.conv_states[0])):
            assert got.shape == want.shape and got.dtype == want.dtype, (where, i, what, got.shape, want.shape)
            err = rel_err(got, want)
            assert err <= STATE_TOL, f"{where}: layer {i} {what} state {err:.2e}"
            assert all(torch.equal(e, got) for e in _every(got, world)), f"{where}: layer {i} {what} differs by rank"
        n += 1
    return n


def _check_shares(out, layout: str, world: int, where: str) -> None:
    """Each rank's attention-layer cache: [B, Hkv, S_r, D] with S_r about 1/P of the tokens held (within the
    layout's padding), the shares summing to them, every real token held exactly once (its column: Note [Masks by column])."""
    cache = out.cache
    held = out.sequences.shape[1] - 1  # the last token is never fed back
    attention = [layer for layer in cache.layers if isinstance(layer, ShardedCacheLayer)]
    assert attention and len(attention) + sum(isinstance(x, ReplicatedLinearLayer) for x in cache.layers) == len(
        cache.layers), where
    assert cache.get_seq_length() == held, (where, cache.get_seq_length(), held)
    for layer in attention:
        s = layer.keys.shape[2]
        sizes = _every(s, world)
        assert sum(sizes) == held, (where, sizes, held)
        assert max(sizes) <= math.ceil(held / world) + layout_unit(layout, world), (where, sizes)
        every_pos = _every(layer.positions.tolist(), world)
        for row in range(out.sequences.shape[0]):
            got = sorted(p for ranks in every_pos for p in ranks[row] if p >= 0)
            assert got == list(range(held - len(got), held)), (where, row, got)  # the row's columns, pads -1


def _check_generate(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    models, checked = {}, {"states": 0, "cases": 0}
    for i, (name, layout, b, n, pad, new) in enumerate(CASES):
        if world > 2 and name in OTHERS:  # the same layers and dispatch as the first three: P = 2 only (CI time)
            continue
        first = name not in models
        base = models.setdefault(name, _model(name).eval())
        ids, mask = _prompt(i, b, n, pad, low=3, vocab=V)
        ref = _generate(copy.deepcopy(base), ids, mask, max_new_tokens=new)
        model = apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        out = _generate(model, ids, mask, max_new_tokens=new)
        where = f"{name} {layout} P={world} B={b} N={n} pad={pad}"
        _compare(out, ref, where)
        assert all(torch.equal(e, torch.stack(out.logits)) for e in _every(torch.stack(out.logits), world)), where
        _check_shares(out, layout, world, where)
        checked["states"] += _compare_states(out.cache, ref.cache, world, where + " after decoding")
        if first:  # the prompt's states alone (one new token: prefill only), once per model
            one, ref_one = _generate(model, ids, mask, max_new_tokens=1), _generate(copy.deepcopy(base), ids, mask,
                                                                                     max_new_tokens=1)
            _compare(one, ref_one, where + " prefill")
            checked["states"] += _compare_states(one.cache, ref_one.cache, world, where + " after the prompt")
        if i == 0:
            _check_options(model, base, ids, mask, n, where, world)
        checked["cases"] += 1
    return checked


def _check_options(model, base, ids, mask, n: int, where: str, world: int) -> None:
    """EOS per row, max_length, seeded sampling, a plain tensor output under inference_mode: as at CP=1."""
    ref = _generate(copy.deepcopy(base), ids, mask, max_new_tokens=6)
    eos = int(ref.sequences[1, n + 1])  # row 1 stops after its second token, row 0 goes on (unless it meets it)
    kw = dict(eos_token_id=eos, max_new_tokens=6)
    _compare(_generate(model, ids, mask, **kw), _generate(copy.deepcopy(base), ids, mask, **kw), where + " eos")
    kw = dict(max_length=n + 3, max_new_tokens=None)
    out = _generate(model, ids, mask, **kw)
    assert out.sequences.shape[1] == n + 3, where
    _compare(out, _generate(copy.deepcopy(base), ids, mask, **kw), where + " max_length")
    torch.manual_seed(5)
    ref3 = _generate(copy.deepcopy(base), ids, mask, do_sample=True, top_k=20, max_new_tokens=5)
    torch.manual_seed(5)
    out3 = _generate(model, ids, mask, do_sample=True, top_k=20, max_new_tokens=5)
    assert all(torch.equal(e, out3.sequences) for e in _every(out3.sequences, world)), where
    assert torch.equal(out3.sequences, ref3.sequences), where + " sampling"
    with torch.inference_mode():  # also under inference_mode, a tensor output
        seq = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(seq, ref.sequences[:, :n + 3]), where + " tensor output, inference_mode"


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_refusals(rank: int, world: int) -> int:
    """Every refusal on every rank, before the first token; the cache's methods; then still in step."""
    mesh = init_device_mesh("cpu", (world,))
    base = _model("qwen3_next").eval()
    model = apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    ids, mask = _prompt(0, 2, 9, [0, 2])
    gen = lambda **kw: _generate(model, ids, mask, **kw)  # noqa: E731
    _expect("num_beams", lambda: gen(num_beams=2))
    _expect("use_cache=False", lambda: gen(use_cache=False))
    _expect("cache_implementation", lambda: gen(cache_implementation="static"))
    _expect("assistant_model", lambda: gen(assistant_model=base))
    _expect("output_hidden_states", lambda: gen(output_hidden_states=True))
    _expect("empty ShardedCache", lambda: gen(cache=ShardedCache(None, 4, [0, 1, 3])))
    right = torch.ones(2, 9, dtype=torch.long)
    right[1, -2:] = 0
    _expect("left padding", lambda: _generate(model, ids, right))
    _expect("refused the call on rank", lambda: gen(num_beams=2 if rank == world - 1 else 1))  # one rank only
    _expect("same call on every rank", lambda: gen(max_new_tokens=4 + (rank == 0)))
    # a plain forward with a cache is still refused (generate() builds its own)
    pos = torch.arange(8)[None]
    _expect("without a cache", lambda: model(input_ids=ids[:, :8], position_ids=pos, use_cache=True))
    # the returned cache: its length is right; cropping, reordering, re-batching raise on every rank
    out = gen()
    cache = out.cache
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    for call in (lambda: cache.crop(-1), lambda: cache.reorder_cache(torch.tensor([1, 0])),
                 lambda: cache.batch_repeat_interleave(2), lambda: cache.batch_select_indices(torch.tensor([0])),
                 lambda: cache.activate_past_recording()):
        _expect("cannot be cropped", call)
    _expect("at least one new one", lambda: gen(cache=cache))  # the same prompt: nothing new to continue with
    # still in step: a good call equals CP=1
    _compare(gen(), _generate(copy.deepcopy(base), ids, mask), "after the refusals")
    return 1


def _all(rank: int, world: int):
    return _check_generate(rank, world), _check_refusals(rank, world)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=slow("P = 3: ~13 s"))])
def test_hybrid_generate_matches_cp1(world):
    """One spawn per P: every case of CASES (tokens, logits, states, shares; the models of OTHERS at P = 2
    only), the options on the first, the refusals and the cache's methods."""
    (checked, refusals), *_ = run_ranks(world, _all, timeout=600.0)
    cases = [c for c in CASES if world == 2 or c[0] not in OTHERS]
    models = {c[0] for c in cases}
    assert checked["cases"] == len(cases) and checked["states"] == 3 * (len(cases) + len(models)) and refusals == 1
