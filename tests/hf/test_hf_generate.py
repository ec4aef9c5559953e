"""transformers generate() under CP (cp_dtensor.hf_generate): every rank gets the tokens and logits of the same
model at CP=1 (run in the same process, attn_implementation="sdpa" / gpt-oss "eager"); each rank's cache
holds its share of the tokens; what cannot be served raises on every rank before the first token."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf.cache import ShardedCache  # noqa: E402

TOL = 1e-4  # fp32 logits, relative to the largest magnitude (the bound)
V = 96
WINDOW = 6  # below the prompt lengths: decoding attends across the window's edge
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, attn_implementation="sdpa")


def _model(name: str):
    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),  # GQA
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=8)),  # MQA
        "mistral": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=WINDOW)),
        # sinks on every layer, layer 0 windowed, layer 1 full; transformers runs it with eager only
        "gpt-oss": (GptOssConfig, GptOssForCausalLM, dict(num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                          num_experts_per_tok=2, intermediate_size=32,
                                                          sliding_window=WINDOW, attn_implementation="eager")),
    }
    cfg_cls, cls, extra = kinds[name]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**TINY, **extra})).float().eval()
    if name == "gpt-oss":
        with torch.no_grad():  # sinks large enough to matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _prompt(seed: int, b: int, n: int, left_pad: list[int] | None = None, *, low: int = 1, vocab: int = V):
    """Token ids [B, n] in [low, vocab) and the 2-D mask of ``left_pad`` pad tokens (id 0) per row, or None.
    Shared with test_hf_hybrid_generate.py."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (b, n), generator=g)
    mask = None
    if left_pad is not None:
        mask = torch.ones(b, n, dtype=torch.long)
        for row, p in enumerate(left_pad):
            mask[row, :p] = 0
            ids[row, :p] = 0
    return ids, mask


def _generate(model, ids, mask, **options):
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **{**kw, **options})


def _check_cache(out, rank: int, world: int, where: str, ref=None) -> None:
    """Each rank's cache: [B, Hkv, S_r, D] per layer, S_r within one of the mean; the S_r sum to the tokens held.
    A windowed layer (Note [Windowed caches]): S_r <= ceil(C / P) + 2 and the S_r sum to at least C, C what the
    CP=1 run's sliding cache (``ref``) holds for that layer."""
    cache = out.cache
    assert isinstance(cache, ShardedCache), where
    held = out.sequences.shape[1] - 1  # the last token is never fed back
    for i, layer in enumerate(cache.layers):
        s = layer.keys.shape[2]
        assert layer.values.shape[2] == s and layer.positions.shape == (out.sequences.shape[0], s), where
        every = [torch.zeros((), dtype=torch.long) for _ in range(world)]
        torch.distributed.all_gather(every, torch.tensor(s))
        sizes = [int(x) for x in every]
        if ref is not None and ref.cache.layers[i].is_sliding:
            c = ref.cache.layers[i].keys.shape[2]
            assert layer.reach is not None and c < held, (where, i, c, held)  # the window cut: CP=1's cache too
            assert max(sizes) <= -(-c // world) + 2 and c <= sum(sizes) <= c + world, (where, i, sizes, c)
        else:
            assert layer.reach is None or ref is None, (where, i)
            assert sum(sizes) == held, (where, sizes, held)
            assert max(sizes) - min(sizes) <= 1, (where, sizes)
        # every real token is held exactly once: each row's columns over all ranks are its last ones (left
        # padding: the row's first columns are pads, held as -1)
        every_pos = [None] * world
        torch.distributed.all_gather_object(every_pos, layer.positions.tolist())
        for row in range(out.sequences.shape[0]):
            got = sorted(p for ranks in every_pos for p in ranks[row] if p >= 0)
            assert got == list(range(out.sequences.shape[1] - 1 - len(got), out.sequences.shape[1] - 1)), (
                where, row, got)


def _compare(out, ref, where: str) -> None:
    assert torch.equal(out.sequences, ref.sequences), f"{where}: tokens\n{out.sequences}\n{ref.sequences}"
    assert len(out.logits) == len(ref.logits), where
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        err = rel_err(a, b)
        assert err <= TOL, f"{where}: step {step} logits {err:.2e}"


def _same_on_every_rank(x: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(every, x.contiguous())
    return all(torch.equal(e, x) for e in every)


CASES = [  # (model, layout, batch, prompt length -- never divisible by 2 or 3 --, left padding per row)
    ("llama", "striped", 2, 13, None),
    ("llama", "headtail", 1, 11, None),
    ("llama", "striped", 3, 19, [0, 5, 2]),  # left padding
    ("qwen3", "striped", 2, 7, [3, 0]),
    ("qwen3", "contiguous", 1, 5, None),
    ("mistral", "striped", 2, 17, [0, 4]),  # window 6 < prompt: decoding crosses its edge
    ("gpt-oss", "striped", 2, 13, [2, 0]),  # sinks, per-layer windows
    ("gpt-oss", "headtail", 1, 1, None),  # a one-token prompt (shorter than P)
    ("llama", "documents", 2, 13, [3, 0]),  # layout="documents": the prompt (one a row) prefills striped
]


def _check_generate(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for i, (name, layout, b, n, pad) in enumerate(CASES):
        base = models.setdefault(name, _model(name))
        ids, mask = _prompt(i, b, n, pad)
        ref = _generate(copy.deepcopy(base), ids, mask)
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        out = _generate(model, ids, mask)
        where = f"{name} {layout} P={world} B={b} N={n} pad={pad}"
        _compare(out, ref, where)
        assert _same_on_every_rank(torch.stack(out.logits), world), where
        _check_cache(out, rank, world, where, ref)
        # EOS: every rank stops at the step the reference does
        if i == 0:
            eos = int(ref.sequences[0, n + 2])
            ref2 = _generate(copy.deepcopy(base), ids[:1], None, eos_token_id=eos, max_new_tokens=8)
            out2 = _generate(model, ids[:1], None, eos_token_id=eos, max_new_tokens=8)
            assert torch.equal(out2.sequences, ref2.sequences) and out2.sequences.shape[1] <= n + 3, where
            # seeded sampling: the same tokens on every rank, and as at CP=1
            torch.manual_seed(5)
            ref3 = _generate(copy.deepcopy(base), ids, None, do_sample=True, top_k=20)
            torch.manual_seed(5)
            out3 = _generate(model, ids, None, do_sample=True, top_k=20)
            assert _same_on_every_rank(out3.sequences, world), where
            assert torch.equal(out3.sequences, ref3.sequences), where
            # plain tensor output (return_dict_in_generate off)
            seq = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert torch.equal(seq, ref.sequences[:, :n + 3]), where


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    base = _model("llama")
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh)
    ids, mask = _prompt(0, 2, 9)
    gen = lambda **kw: _generate(model, ids, mask, **kw)  # noqa: E731
    _expect("num_beams", lambda: gen(num_beams=2))
    _expect("passed use_cache=False.*Drop use_cache=False", lambda: gen(use_cache=False))
    _expect("cache_implementation", lambda: gen(cache_implementation="static"))
    _expect("assistant_model", lambda: gen(assistant_model=base))
    _expect("output_hidden_states", lambda: gen(output_hidden_states=True))
    _expect("empty ShardedCache", lambda: gen(cache=ShardedCache(None, 2)))
    right = torch.ones(2, 9, dtype=torch.long)
    right[1, -2:] = 0
    _expect("left padding", lambda: _generate(model, ids, right))
    _expect("padding inside", lambda: _generate(model, ids, torch.tensor([[1] * 9, [1, 1, 0, 0] + [1] * 5])))
    # on one rank only
    _expect("refused the call on rank", lambda: gen(num_beams=2 if rank == world - 1 else 1))
    _expect("same call on every rank", lambda: gen(max_new_tokens=6 + (rank == 0)))
    # a sharded prompt (each rank its own tokens): refused, not decoded from each rank's last token
    from cp_dtensor import shard_batch

    shard = shard_batch(ids[:, :8], mesh)
    _expect("same call on every rank", lambda: _generate(model, shard, None))
    # still in step: a good call equals CP=1
    _compare(gen(), _generate(copy.deepcopy(base), ids, mask), "after the refusals")


@pytest.mark.parametrize("world", [2, 3])
def test_generate_matches_cp1(world):
    """Llama (GQA), Qwen3 (MQA), Mistral (window), gpt-oss (sinks, per-layer windows); striped / headtail /
    contiguous; prompt lengths not divisible by P, left padding, a one-token prompt; greedy tokens and every
    step's logits vs CP=1, EOS, seeded sampling; the cache's share per rank."""
    run_ranks(world, _check_generate)


def test_generate_refusals_raise_on_every_rank():
    run_ranks(2, _check_refusals)
