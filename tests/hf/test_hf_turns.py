"""Continuing generate()'s sharded cache under CP (hf/turns.py, Note [Continuing a sharded cache]): a second and
third turn of a conversation, and ``prefill_chunk_size``, against the same model at CP=1 in the same process
(transformers continuing its own DynamicCache, or prefilling unchunked): greedy tokens identical, every step's
logits within 1e-4; each rank's cache within one token of the mean; both ways of running a turn (pass-Q, pass-KV)
exercised; the bytes of a pass-Q turn independent of the conversation's length, and of both modes by the formula;
a cache or conversation that cannot be continued raises on every rank before any communication."""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from _tiers import slow
from test_hf_generate import _check_cache, _compare, _generate, _model, _prompt, _same_on_every_rank
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from _dist import run_ranks

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers import DynamicCache  # noqa: E402

from cp_dtensor.core.plan.layout import layout_unit  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf.turns import turn_plan  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402

V = 96
TURNS = [  # (model, layout, left padding of the first turn's prompt, its length, follow-ups' lengths)
    # short follow-ups run pass-Q; one of 30 after ~30 cached runs pass-KV
    ("llama", "striped", [3, 0], 13, (5, 30)),  # GQA
    ("mistral", "striped", [0, 4], 11, (5, 29)),  # window 6: the new tokens' windows reach into the cached turns
    ("gpt-oss", "striped", [2, 0], 13, (4, 2)),  # sinks, per-layer windows, MoE
    ("llama", "headtail", [1, 0], 9, (7, 25)),  # another layout's cache
]


def _follow(ids, mask, seed: int, n: int):
    """The conversation so far [B, M] and its mask, with a follow-up of ``n`` tokens appended to every row."""
    extra = torch.randint(1, V, (ids.shape[0], n), generator=torch.Generator().manual_seed(seed))
    ones = torch.ones(ids.shape[0], ids.shape[1] + n - mask.shape[1], dtype=mask.dtype)
    return torch.cat([ids, extra], 1), torch.cat([mask, ones], 1)


def _share_bound(out, world: int, where: str) -> None:
    """Each rank's cache holds at most ceil(total / P) tokens (the balance rule keeps shares within one)."""
    total = out.sequences.shape[1] - 1
    s = out.cache.layers[0].keys.shape[2]
    assert s <= math.ceil(total / world), (where, s, total)


def _check_turns(rank: int, world: int, full: bool) -> int:
    """Every case at P=2; at P=3 the first three (the default tier's time)."""
    mesh = init_device_mesh("cpu", (world,))
    checked, runs = 0, Counter()
    for i, (name, layout, pad, n, follow) in enumerate(TURNS if full else TURNS[:3]):
        base = _model(name)
        ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        ids, mask = _prompt(i, 2, n, pad)
        ref, out = _generate(ref_model, ids, mask), _generate(model, ids, mask)
        _compare(out, ref, f"{name} turn 1")
        for turn, t in enumerate(follow, 2):
            where = f"{name} {layout} P={world} turn {turn}"
            ids, mask = _follow(out.sequences, mask, 10 * i + turn, t)
            cached = out.cache.get_seq_length()
            ref = _generate(ref_model, ids, mask, cache=ref.cache)  # CP=1: transformers continues its DynamicCache
            out = _generate(model, ids, mask, cache=out.cache)
            _compare(out, ref, where)
            assert out.cache.get_seq_length() == out.sequences.shape[1] - 1 > cached, where
            assert _same_on_every_rank(torch.stack(out.logits), world), where
            _check_cache(out, rank, world, where, ref)
            _share_bound(out, world, where)
            checked += 1
        runs += out.cache.runs
    assert runs["pass-kv"] > 0 and runs["decode"] > 0, runs  # both ways of running a turn were checked
    # transformers' older keyword past_key_values= too, and a conversation that is the cache's plus one token
    base = _model("llama")
    ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh)
    ids, mask = _prompt(7, 2, 10, [0, 2])
    ref, out = _generate(ref_model, ids, mask, max_new_tokens=3), _generate(model, ids, mask, max_new_tokens=3)
    mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    ref = _generate(ref_model, ref.sequences, mask, cache=ref.cache)
    _compare(_generate(model, out.sequences, mask, past_key_values=out.cache), ref, "past_key_values=")
    return checked + 1


CHUNKED = [  # (model, layout, batch, prompt length, left padding, prefill_chunk_size)
    ("llama", "striped", 2, 70, [5, 0], 16),  # the case
    ("mistral", "striped", 2, 29, [17, 0], 8),  # window 6 across chunk edges; a chunk all padding in row 0
    ("gpt-oss", "headtail", 1, 23, None, 5),
    ("llama", "striped", 1, 9, None, 16),  # one chunk: the plain prefill
]


def _check_chunked(rank: int, world: int, full: bool) -> int:
    mesh = init_device_mesh("cpu", (world,))
    for i, (name, layout, b, n, pad, chunk) in enumerate(CHUNKED if full else CHUNKED[:1]):
        base = _model(name)
        ids, mask = _prompt(20 + i, b, n, pad)
        ref = _generate(copy.deepcopy(base), ids, mask)  # CP=1, unchunked
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        out = _generate(model, ids, mask, prefill_chunk_size=chunk)
        where = f"{name} {layout} P={world} N={n} chunk={chunk}"
        _compare(out, ref, where)
        _check_cache(out, rank, world, where, ref)
    return len(CHUNKED) if full else 1


def _ragged(ids, mask, seed: int, lens):
    """The conversation so far [B, M] with follow-ups of ``lens`` tokens (one a row), each padded on the left to
    the longest: padding inside the conversation, which transformers' windows count (Note [Masks by column])."""
    g, t = torch.Generator().manual_seed(seed), max(lens)
    new = torch.zeros(ids.shape[0], t, dtype=torch.long)
    real = torch.zeros(ids.shape[0], t, dtype=mask.dtype)
    for row, n in enumerate(lens):
        new[row, t - n:], real[row, t - n:] = torch.randint(1, V, (n,), generator=g), 1
    ones = torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)
    return torch.cat([ids, new], 1), torch.cat([mask, ones, real], 1)


RAGGED = [  # (model, follow-ups' lengths per row, turn by turn): windows across padding inside the conversation
    ("mistral", [(3, 7), (30, 12)]),  # pass-Q, then pass-KV
    ("gpt-oss", [(20, 30), (2, 5)]),  # pass-KV, then pass-Q; sinks, MoE
]


def _check_ragged(rank: int, world: int, full: bool) -> int:
    """Ragged follow-ups (padding inside the conversation) and a chunked prefill with padding after its first
    chunk, with sliding windows: the tokens and logits of the model without CP; padding inside the first chunk
    is refused on every rank."""
    mesh = init_device_mesh("cpu", (world,))
    runs = Counter()
    for i, (name, follow) in enumerate(RAGGED if full else RAGGED[:1]):  # the default tier's P=3: Mistral
        base = _model(name)
        ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh)
        ids, mask = _prompt(40 + i, 2, 11, [0, 3])
        ref, out = _generate(ref_model, ids, mask), _generate(model, ids, mask)
        for turn, lens in enumerate(follow, 2):
            ids, mask = _ragged(out.sequences, mask, 10 * i + turn, lens)
            ref = _generate(ref_model, ids, mask, cache=ref.cache)
            out = _generate(model, ids, mask, cache=out.cache)
            _compare(out, ref, f"{name} P={world} ragged turn {turn} {lens}")
        runs += out.cache.runs
        ids, mask = _prompt(50 + i, 2, 30, [0, 3])
        mask[1, 12:15] = 0  # padding inside row 1, after the first chunk
        ids[1, 12:15] = 0
        ref = _generate(copy.deepcopy(base), ids, mask)
        chunked = _generate(model, ids, mask, prefill_chunk_size=8)
        _compare(chunked, ref, f"{name} P={world} chunked, padding inside")
        runs += chunked.cache.runs
        _expect(r"padding inside the prompt \(a pad at column 12.*within its first chunk of 16.*prefill_chunk_size "
                r"<= 12", lambda: _generate(model, ids, mask, prefill_chunk_size=16))
        _expect("padding inside the prompt", lambda: _generate(model, ids, mask))
    assert runs["pass-kv"] > 0 and runs["decode"] > 0, runs
    return 1


def _turn_bytes(model, cached: int, new: int) -> int:
    """Bytes this rank sends for a turn of ``new`` tokens (one forward, no decoding) after ``cached`` ones."""
    ids = torch.randint(1, V, (1, cached), generator=torch.Generator().manual_seed(cached))
    out = _generate(model, ids, None, max_new_tokens=1)  # the cache holds the prompt's ``cached`` tokens
    ids2 = torch.cat([out.sequences, torch.randint(1, V, (1, new - 1))], 1)  # the last token is new too
    with CommBytes() as cb:
        _generate(model, ids2, None, cache=out.cache, max_new_tokens=1)
    return cb.sent


def _check_bytes(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    base = _model("llama")
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh)
    cfg = base.config
    short, long = _turn_bytes(model, 48, 6), _turn_bytes(model, 144, 6)
    assert abs(long - short) <= 0.25 * short, (short, long)
    plan = turn_plan(new=6, cached=144, cp=world, batch=1, q_heads=cfg.num_attention_heads,
                     kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads)
    assert long == cfg.num_hidden_layers * plan.pass_q, (long, plan)  # the formula, per layer
    assert plan.mode == "pass-q", plan
    # a long turn on a short conversation: pass-KV, by the formula (+ the cache positions, once a forward)
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(1))
    out = _generate(model, ids, None, max_new_tokens=1)
    with CommBytes() as cb:
        again = _generate(model, torch.cat([out.sequences, ids.flip(1), ids], 1), None, cache=out.cache,
                          max_new_tokens=1)
    plan = turn_plan(new=25, cached=12, cp=world, batch=2, q_heads=cfg.num_attention_heads,
                     kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads, kv_bytes=4,
                     unit=layout_unit("striped", world))
    assert plan.mode == "pass-kv" and again.cache.runs["pass-kv"] == 1, (plan, again.cache.runs)
    positions = (world - 1) * 2 * math.ceil(12 / world) * 8  # the cache shares' positions, once
    head = (world - 1) * 2 * cfg.hidden_size * 4  # the row the LM head reads, as after a prefill
    assert cb.sent == cfg.num_hidden_layers * plan.pass_kv + positions + head, (cb.sent, dict(cb.by_op), plan)
    assert plan.pass_kv < plan.pass_q, plan


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    base = _model("llama")
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh)
    ids, mask = _prompt(3, 2, 9, [2, 0])
    out = _generate(model, ids, mask, max_new_tokens=3)
    ids2, mask2 = _follow(out.sequences, mask, 1, 4)
    go = lambda cache, i=ids2, m=mask2: _generate(model, i, m, cache=cache)  # noqa: E731
    _expect("got a DynamicCache", lambda: go(DynamicCache()))
    plain = copy.deepcopy(base)  # a cache of CP=1 (a plain model's)
    _expect("got a DynamicCache", lambda: go(_generate(plain, ids, mask, max_new_tokens=3).cache))
    headtail = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    _expect(r"another CP run \(P=\d, rank \d, layout 'headtail'\)", lambda: go(
        _generate(headtail, ids, mask, max_new_tokens=3).cache))
    # a cache of another CP size: each rank's own CP=1 run (a group of one)
    solo = [dist.new_group([r]) for r in range(world)]
    alone = hf.apply_context_parallel(copy.deepcopy(base), DeviceMesh.from_group(solo[rank], "cpu"))
    _expect(r"another CP run \(P=1", lambda: go(_generate(alone, ids, mask, max_new_tokens=3).cache))
    edited = ids2.clone()
    edited[1, 4] = (edited[1, 4] + 1) % V
    _expect("edited history", lambda: go(out.cache, edited))
    repadded = mask2.clone()
    repadded[1, 0] = 0  # other padding than the first turn's
    _expect("edited history", lambda: go(out.cache, ids2, repadded))
    _expect("at least one new one", lambda: go(out.cache, out.sequences[:, :-1], mask2[:, :11]))
    _expect("batch 2, but input_ids has 1", lambda: go(out.cache, ids2[:1], mask2[:1]))
    _expect("both cache= and past_key_values=", lambda: _generate(model, ids2, mask2, cache=out.cache,
                                                                  past_key_values=out.cache))
    with torch.no_grad():  # a forward given the cache (a hand-written loop): generate() continues it, not a forward
        _expect("pass no cache to a forward", lambda: model(input_ids=ids2[:, -2:], position_ids=torch.arange(
            12, 14)[None].expand(2, 2), cache=out.cache))
    # on one rank only: refused on every rank
    _expect("refused the call on rank", lambda: go(DynamicCache() if rank == world - 1 else out.cache))
    _expect(r"passed different caches \(rank 0: a ShardedCache of 11 columns \(shares \[[\d, ]+\]\); rank 1: no cache",
            lambda: go(out.cache if rank == 0 else None))
    other, mask3 = _follow(out.sequences, mask, 2 + rank, 4)  # a follow-up that differs between ranks
    _expect("same call on every rank", lambda: go(out.cache, other, mask3))
    # still in step: the refused calls changed nothing; the good one equals CP=1
    ref = _generate(plain, ids, mask, max_new_tokens=3)
    _compare(go(out.cache), _generate(plain, ids2, mask2, cache=ref.cache), "after the refusals")


class _Fails(transformers.StoppingCriteria):
    """A stopping criterion that raises at the ``at``-th step (on every rank): a turn that fails midway."""

    def __init__(self, at: int):
        self.at, self.steps = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("stopped midway")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _check_failed_turns(rank: int, world: int) -> None:
    """A failed turn leaves the cache as it was (the retry equals transformers' retry); inference-mode caches
    continue under no_grad; a model of other K/V heads is refused; the refusals say what to pass."""
    mesh = init_device_mesh("cpu", (world,))
    base = _model("mistral")
    ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh)
    ids, mask = _prompt(60, 2, 11, [0, 3])
    with torch.inference_mode():  # turn 1 under inference mode, turn 2 under no_grad (_generate): as transformers
        ref, out = _generate(ref_model, ids, mask), _generate(model, ids, mask)
    ids2, mask2 = _ragged(out.sequences, mask, 61, (4, 6))
    held = out.cache.get_seq_length()
    with pytest.raises(RuntimeError, match="stopped midway"):  # a turn that fails at its third step
        _generate(model, ids2, mask2, cache=out.cache, stopping_criteria=[_Fails(3)])
    assert out.cache.get_seq_length() == held and out.cache.layers[0].keys.shape[2] <= math.ceil(held / world)
    other = copy.deepcopy(base.config)
    other.num_key_value_heads = 4  # another model shape: refused on every rank before anything runs
    wrong = hf.apply_context_parallel(type(base)(other).eval(), mesh)
    _expect(r"another model shape \(K/V heads 2; this model: K/V heads 4\)",
            lambda: _generate(wrong, ids2, mask2, cache=out.cache))
    ref2 = _generate(ref_model, ids2, mask2, cache=ref.cache)  # the retry with the right model: transformers'
    branch = copy.deepcopy(out.cache)  # a copy branches the conversation
    out2 = _generate(model, ids2, mask2, cache=out.cache)
    _compare(out2, ref2, f"P={world} retried turn")
    # a second follow-up from the cache the first one continued: the message says to copy it
    ids3, mask3 = _ragged(out.sequences, mask, 62, (5, 2))
    _expect(r"updated in place.*copy.deepcopy", lambda: _generate(model, ids3, mask3, cache=out.cache))
    ref_branch = copy.deepcopy(ref_model)
    ref3 = _generate(ref_branch, ids3, mask3, cache=_generate(ref_branch, ids, mask).cache)
    _compare(_generate(model, ids3, mask3, cache=branch), ref3, f"P={world} branched")
    # the new tokens alone, with the whole conversation's mask
    _expect(r"takes the whole conversation.*the new tokens alone",
            lambda: _generate(model, ids3[:, -5:], mask3, cache=copy.deepcopy(branch)))
    _expect(r"the follow-up alone", lambda: _generate(model, ids3[:, -5:], None, cache=copy.deepcopy(branch)))
    # the generated columns masked with 0 (a mask derived from the pad token): say they keep mask 1
    ids4, zeroed = _follow(out2.sequences, mask2, 63, 3)
    zeroed[0, mask2.shape[1] + 1] = 0
    _expect(r"columns a generate\(\) call produced keep mask 1", lambda: _generate(model, ids4, zeroed, cache=out2.cache))
    with warnings.catch_warnings():  # past_key_values=None is no cache, without a warning (as transformers)
        warnings.simplefilter("error")
        _compare(_generate(model, ids, mask, past_key_values=None), _generate(copy.deepcopy(base), ids, mask),
                 "past_key_values=None")


def _check_hybrid(rank: int, world: int) -> None:
    """A hybrid (Gated DeltaNet + attention, headtail): turn 2 continues the linear layers' full states and the
    attention layers' shares; a chunked prefill equals the unchunked CP=1 run."""
    from test_hf_hybrid_generate import _model as _hybrid

    mesh = init_device_mesh("cpu", (world,))
    base = _hybrid("qwen3_next").eval()
    ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    ids, mask = _prompt(5, 2, 11, [0, 3], vocab=128)
    ref, out = _generate(ref_model, ids, mask, max_new_tokens=3), _generate(model, ids, mask, max_new_tokens=3)
    ids, mask = _follow(out.sequences, mask, 6, 5)
    _compare(_generate(model, ids, mask, cache=out.cache), _generate(ref_model, ids, mask, cache=ref.cache),
             f"qwen3_next P={world} turn 2")
    _compare(_generate(model, ids, mask, prefill_chunk_size=6), _generate(copy.deepcopy(base), ids, mask),
             f"qwen3_next P={world} chunked")


def _windowed_shares(out, ref, world: int, where: str) -> int:
    """Each windowed layer's share <= ceil(C / P) + 2 and the shares together >= C, C what CP=1's sliding cache
    holds for the layer (Note [Windowed caches]); returns how many windowed layers."""
    n = 0
    for layer, ref_layer in zip(out.cache.layers, ref.cache.layers):
        if getattr(ref_layer, "is_sliding", False):
            c, sizes = ref_layer.keys.shape[2], [None] * world
            dist.all_gather_object(sizes, layer.keys.shape[2])
            assert layer.reach is not None and max(sizes) <= -(-c // world) + 2 and sum(sizes) >= c, (where, sizes, c)
            n += 1
    return n


def _check_hybrid_windowed(rank: int, world: int) -> None:
    """A hybrid with a sliding-window layer (Lara-Mini: Gated DeltaNet, MoE; window 6), headtail: three turns equal
    CP=1, and after turns 2 and 3 the windowed layer's shares are trimmed to what the window reaches."""
    from test_hf_hybrid_generate import OTHERS

    cfg_cls, cls, extra = OTHERS["lara_mini"]
    torch.manual_seed(0)
    types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    base = cls(cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa", layer_types=types,
                       sliding_window=6, pad_token_id=0, **extra)).float().eval()
    mesh = init_device_mesh("cpu", (world,))
    ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    ids, mask = _prompt(70, 2, 11, [0, 3], vocab=128)
    ref, out = _generate(ref_model, ids, mask, max_new_tokens=3), _generate(model, ids, mask, max_new_tokens=3)
    _compare(out, ref, f"lara_mini P={world} turn 1")
    for turn, t in enumerate((6, 7), 2):
        ids, mask = _follow(out.sequences, mask, 70 + turn, t)
        ref, out = _generate(ref_model, ids, mask, cache=ref.cache), _generate(model, ids, mask, cache=out.cache)
        _compare(out, ref, f"lara_mini P={world} turn {turn}")
        assert _windowed_shares(out, ref, world, f"lara_mini P={world} turn {turn}") == 1


def _check_latent_cache(rank: int, world: int) -> None:
    """DeepSeek-V3's MLA caches the compressed latent and expands it per forward. On the ring (the default) the
    attention takes the expansion, not what it caches, and a long turn (pass-KV for a model caching its K/V) runs
    pass-Q on the latent shares; with kv_exchange="latent" the prefill's layers run the latent path and the long
    turn runs pass-KV on the cached latent rows (Note [MLA turns] in hf/latent.py). Both equal CP=1."""
    for exchange in ("ring", "latent"):
        _latent_turn(world, exchange)


def _latent_turn(world: int, exchange: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    cfg = transformers.DeepseekV3Config(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                        qk_nope_head_dim=8, v_head_dim=8, head_dim=4)
    torch.manual_seed(0)
    base = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    ref_model, model = copy.deepcopy(base), hf.apply_context_parallel(copy.deepcopy(base), mesh, kv_exchange=exchange)
    ids, mask, rows = *_prompt(8, 2, 6, [0, 2]), exchange == "latent"
    from cp_dtensor.hf import latent

    calls, attend = [], latent.attend
    latent.attend = lambda *a, **k: calls.append(1) or attend(*a, **k)  # the prefill's layers on the latent path?
    try:
        ref, out = _generate(ref_model, ids, mask, max_new_tokens=2), _generate(model, ids, mask, max_new_tokens=2)
    finally:
        latent.attend = attend
    assert len(calls) == (2 if rows else 0), (exchange, calls)
    ids, mask = _follow(out.sequences, mask, 9, 60)  # 60 new after 7 cached: pass-KV by the bytes rule
    out = _generate(model, ids, mask, cache=out.cache, max_new_tokens=2)
    _compare(out, _generate(ref_model, ids, mask, cache=ref.cache, max_new_tokens=2), f"deepseek_v3 P={world} turn 2")
    assert out.cache.attends_cached == rows and out.cache.runs["pass-kv"] == int(rows), (exchange, out.cache.runs)


def _all(rank: int, world: int, full: bool) -> int:
    n = _check_turns(rank, world, full) + _check_chunked(rank, world, full) + _check_ragged(rank, world, full)
    if full:
        _check_latent_cache(rank, world)
        _check_hybrid(rank, world)
        _check_bytes(rank, world)
        _check_refusals(rank, world)
        _check_failed_turns(rank, world)
        if world > 2:  # the slow tier's
            _check_hybrid_windowed(rank, world)
    return n


@pytest.mark.parametrize("world", [2, 3])
def test_turns_and_chunked_prefill_match_cp1(world):
    """Turns 2 and 3 (GQA Llama, Mistral window spanning the turns, gpt-oss sinks + MoE, a headtail cache; batch
    2 with left padding) and prefill_chunk_size (16 on a 70-token prompt, ...) vs CP=1; at P=2 also the bytes of
    a 6-token turn after 48 and 144 cached tokens, and the refusals."""
    checked, *_ = run_ranks(world, _all, world == 2)
    assert checked == (10 + len(CHUNKED) if world == 2 else 9), checked


@slow("every case at P = 3 and 4")
@pytest.mark.parametrize("world", [3, 4])
def test_turns_every_case_more_ranks(world):
    """The default test's every case (turns, chunks, the hybrid, bytes, refusals) at P = 3 and 4, and a hybrid with
    a sliding-window layer (Lara-Mini) over three turns, its windowed shares trimmed."""
    checked, *_ = run_ranks(world, _all, True, timeout=600.0)
    assert checked == 10 + len(CHUNKED), checked
