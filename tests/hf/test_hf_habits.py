"""generate() and evaluation of transformers models under CP as users call them: rank-dependent stopping
(max_time, criteria, stop strings, EOS, synced_gpus), per-rank seeds, copies of the model (deepcopy,
state_dict, torch.save) and taking CP off, the full inputs given to a forward on every rank,
torch.inference_mode, and the refusals' messages. Every result is compared with the same model at CP=1 (run
in the same process) or checked identical on every rank; a hang is bounded by the launcher's timeouts."""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

import cp_dtensor  # noqa: E402
from cp_dtensor import hf, shard_batch, unshard_batch  # noqa: E402

TOL = 1e-4  # fp32 logits, relative to the largest magnitude
V, N = 96, 13  # vocabulary; prompt length (divisible by neither 2 nor 3)
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        attn_implementation="sdpa")).eval()


def _hybrid(types=("linear_attention", "full_attention")):
    """Qwen3-Next with a linear-attention layer, then a full-attention one."""
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=len(types),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=list(types),
                          linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0, max_position_embeddings=256,
                          attn_implementation="sdpa")
    return Qwen3NextForCausalLM(cfg).float().eval()


def _prompt(seed: int, b: int = 2, n: int = N, left_pad: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V - 1, (b, n), generator=g)
    mask = None
    if left_pad is not None:
        mask = torch.ones(b, n, dtype=torch.long)
        for row, p in enumerate(left_pad):
            mask[row, :p], ids[row, :p] = 0, 0
    return ids, mask


def _same_on_every_rank(x: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(every, x.contiguous())
    return all(torch.equal(e, x) for e in every)


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


class _StopAt(StoppingCriteria):
    """Stops every row once the sequence is ``length`` long."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class _BanBest(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.scatter(1, scores.argmax(1, keepdim=True), float("-inf"))


def _tokenizer():
    vocab = {f"w{i}": i for i in range(V - 1)}
    vocab["abcdef"] = V - 1  # the static prefix transformers' StopStringCriteria tokenizes
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def _stopping(rank: int, world: int, base, model) -> None:
    """Every decision that can differ by rank is rank 0's; every rank returns what CP=1 returns."""
    ids, _ = _prompt(1)
    ref_model = copy.deepcopy(base)
    gen = lambda m, **kw: m.generate(input_ids=ids, **{**GREEDY, **kw})  # noqa: E731
    with torch.no_grad():
        full = gen(ref_model, max_new_tokens=8)
        # the caller's criteria differ by rank: rank 0's decide
        out = gen(model, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([_StopAt(N + 3 + rank)]))
        assert torch.equal(out, full[:, :N + 3]), (rank, out.shape)
        # max_time differs by rank (as clocks do): rank 0's decides, with and without synced_gpus
        for synced in (False, True):
            out = gen(model, max_new_tokens=8, max_time=1e3 if rank == 0 else 0.0, synced_gpus=synced)
            assert torch.equal(out, full), (rank, synced, out.shape)
            out = gen(model, max_new_tokens=8, max_time=0.0 if rank == 0 else 1e3, synced_gpus=synced)
            assert torch.equal(out, full[:, :N + 1]), (rank, synced, out.shape)
        # one max_time for all: ranks end at one step (the habit that aborted in gloo), a prefix of CP=1's tokens
        out = gen(model, max_new_tokens=200, max_time=0.1)
        assert _same_on_every_rank(torch.tensor(out.shape), world) and _same_on_every_rank(out, world)
        longer = gen(ref_model, max_new_tokens=out.shape[1] - N)
        assert torch.equal(out, longer)
        # EOS per row: row 0 ends early, row 1 runs on (padded after its EOS as at CP=1)
        eos = int(full[0, N + 1])
        assert torch.equal(gen(model, max_new_tokens=8, eos_token_id=eos), gen(ref_model, max_new_tokens=8,
                                                                               eos_token_id=eos))
        # stop strings
        tok = _tokenizer()
        stop = tok.convert_ids_to_tokens([int(full[1, N + 2])])
        kw = dict(max_new_tokens=8, stop_strings=stop, tokenizer=tok)
        assert torch.equal(gen(model, **kw), gen(ref_model, **kw))


def _sampling(rank: int, world: int, base, model) -> None:
    """Per-rank seeds: every rank samples what CP=1 samples after rank 0's seed; the other ranks' generators are
    left as they were; a rank-dependent logits processor raises on every rank."""
    ids, mask = _prompt(2, left_pad=[0, 3])
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=20, max_new_tokens=6, pad_token_id=0,
              eos_token_id=None)
    ref_model = copy.deepcopy(base)
    with torch.no_grad():
        torch.manual_seed(11)
        ref = ref_model.generate(**kw)
        ref_after = torch.get_rng_state()
        torch.manual_seed(11 + rank)  # the usual distributed habit
        before = torch.get_rng_state()
        out = model.generate(**kw)
        assert torch.equal(out, ref), (rank, out, ref)
        assert torch.equal(torch.get_rng_state(), ref_after if rank == 0 else before), rank
        # EOS reachable: every rank stops where CP=1 does
        eos = int(ref[0, N + 1])
        torch.manual_seed(11)
        ref = ref_model.generate(**{**kw, "eos_token_id": eos})
        torch.manual_seed(11 + rank)
        assert torch.equal(model.generate(**{**kw, "eos_token_id": eos}), ref), rank
        # tokens that differ between ranks (a logits processor on one rank only): every rank raises, at step 1
        procs = LogitsProcessorList([_BanBest()] if rank == world - 1 else [])
        _expect("chose different tokens", lambda: model.generate(**{**kw, "do_sample": False}, logits_processor=procs))
        # still in step
        assert torch.equal(model.generate(**{**kw, "do_sample": False}), ref_model.generate(**{**kw, "do_sample": False}))


def _scaled(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)
    return model


def _logits(model, mesh, ids, **kw):
    """The full logits of a CP model from this rank's shard (positions 0..N-1)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    ids_s, pos_s = shard_batch((ids, pos), mesh, layout=hf_layout(model))
    out = model(input_ids=ids_s, position_ids=pos_s, **kw).logits
    return unshard_batch(out, mesh, layout=hf_layout(model))


def hf_layout(model) -> str:
    return model._cp_dtensor_hf.layout


def _copies(rank: int, world: int, base, model, mesh) -> None:
    """A copy of a CP model (deepcopy, state_dict, torch.save) generates, evaluates and refuses with its own
    weights; remove_context_parallel gives back the plain model."""
    ids, _ = _prompt(3, n=12)
    ref = _scaled(copy.deepcopy(base))
    clone = _scaled(copy.deepcopy(model))  # an EMA / reference copy, changed after the copy
    with torch.no_grad():
        want, want_logits = ref.generate(input_ids=ids, max_new_tokens=5, **GREEDY), ref(input_ids=ids).logits
        plain_want = copy.deepcopy(base).generate(input_ids=ids, max_new_tokens=5, **GREEDY)
        assert torch.equal(clone.generate(input_ids=ids, max_new_tokens=5, **GREEDY), want)
        assert rel_err(_logits(clone, mesh, ids), want_logits) <= TOL
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, **GREEDY), plain_want)  # untouched
        pos = shard_batch(torch.arange(12)[None], mesh)
        _expect("labels= alone", lambda: clone(input_ids=shard_batch(ids, mesh), position_ids=pos,
                                               labels=shard_batch(ids, mesh)))
        # state_dict round trip into a fresh CP model; the keys are the plain model's
        sd = clone.state_dict()
        assert list(sd) == list(base.state_dict())
        fresh = hf.apply_context_parallel(copy.deepcopy(base), mesh)
        fresh.load_state_dict(sd)
        assert torch.equal(fresh.generate(input_ids=ids, max_new_tokens=5, **GREEDY), want)
        # torch.save / torch.load of the module (same ranks, same process groups)
        buf = io.BytesIO()
        torch.save(clone, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.model.layers[0].self_attn._cp_dtensor_hf is loaded._cp_dtensor_hf
        assert torch.equal(loaded.generate(input_ids=ids, max_new_tokens=5, **GREEDY), want)
        assert rel_err(_logits(loaded, mesh, ids), want_logits) <= TOL
        assert torch.equal(cp_dtensor.remove_context_parallel(loaded)(input_ids=ids).logits, want_logits)
        # taking CP off a copy: the plain model, bit for bit what it was
        plain = cp_dtensor.remove_context_parallel(copy.deepcopy(clone))
        assert plain.config._attn_implementation == "sdpa" and "generate" not in plain.__dict__
        assert not any(hasattr(m, "_cp_dtensor_hf") for m in plain.modules())
        assert torch.equal(plain(input_ids=ids).logits, want_logits)
        assert torch.equal(plain.generate(input_ids=ids, max_new_tokens=5, **GREEDY), want)
        again = hf.apply_context_parallel(plain, mesh, layout="headtail")
        assert torch.equal(again.generate(input_ids=ids, max_new_tokens=5, **GREEDY), want)
        _expect("submodule", lambda: hf.remove_context_parallel(clone.model))


class _TinyAttention(nn.Module):
    """An own model: one causal self-attention layer through F.scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):  # x: [B, S, 16]
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)  # each [B, 2, S, 8]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


def _own_model(rank: int, world: int, mesh) -> None:
    """apply_context_parallel's own models: a deepcopy runs its own weights under CP; removal gives the plain one."""
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(4))
    base = _TinyAttention()
    cp = cp_dtensor.apply_context_parallel(copy.deepcopy(base), mesh)
    clone = _scaled(copy.deepcopy(cp))
    with torch.no_grad():
        got = unshard_batch(clone(shard_batch(x, mesh)), mesh)
        assert rel_err(got, _scaled(copy.deepcopy(base))(x)) <= TOL
        buf = io.BytesIO()
        torch.save(cp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert rel_err(unshard_batch(loaded(shard_batch(x, mesh)), mesh), base(x)) <= TOL
        with torch.inference_mode():  # two packed documents of 5 and 7 tokens: each as if alone
            docs = (torch.arange(12) >= 5).long().expand(2, 12)
            x_s, d_s = shard_batch((x, docs), mesh)
            got = unshard_batch(cp(x_s, document_ids=d_s), mesh)
            assert rel_err(got, torch.cat([base(x[:, :5]), base(x[:, 5:])], 1)) <= TOL
        plain = cp_dtensor.remove_context_parallel(clone)
        assert not any(hasattr(m, "_cp_dtensor_mode") for m in plain.modules())
        assert torch.equal(plain(x), _scaled(copy.deepcopy(base))(x))  # the whole sequence, no ring
        _expect("submodule", lambda: cp_dtensor.remove_context_parallel(cp.qkv))


def _unsharded(rank: int, world: int, base, model, hybrid, mesh) -> None:
    """The full inputs on every rank raise on every rank; packed documents that fill one shard each do not."""
    ids, _ = _prompt(5, n=12)
    pos = torch.arange(12).expand_as(ids)
    with torch.no_grad():
        _expect("shard_batch", lambda: model(input_ids=ids, position_ids=pos))
        _expect("shard_batch", lambda: hybrid(input_ids=ids, position_ids=pos))
        linear = hf.apply_context_parallel(_hybrid(("linear_attention",)), mesh, layout="headtail")
        for m in (hybrid, linear):  # a mask of ones: the linear layers' one-document shortcut must not skip the test
            _expect("shard_batch", lambda: m(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)))
        # world documents, one per rank's contiguous shard, all with positions 0..L-1: real documents
        cont = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="contiguous")
        docs = torch.arange(12 * world).remainder(12)[None]
        tokens = torch.randint(1, V, (1, 12 * world), generator=torch.Generator().manual_seed(6))
        ref = base(input_ids=tokens, position_ids=docs, use_cache=False).logits
        t_s, p_s = shard_batch((tokens, docs), mesh, layout="contiguous")
        got = unshard_batch(cont(input_ids=t_s, position_ids=p_s, use_cache=False).logits, mesh, layout="contiguous")
        assert rel_err(got, ref) <= TOL


def _inference_mode(rank: int, world: int, base, model, hybrid_base, hybrid, mesh) -> None:
    """torch.inference_mode() and torch.no_grad() alike: generate, evaluation forwards (with padding), hybrids
    (a deepcopy of the CP hybrid with its own weights; then CP taken off it)."""
    hybrid_base, hybrid = _scaled(copy.deepcopy(hybrid_base)), _scaled(copy.deepcopy(hybrid))
    ids, mask = _prompt(7, left_pad=[0, 4])
    ref_model = copy.deepcopy(base)
    with torch.no_grad():
        want = ref_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    ids12, _ = _prompt(8, n=12)
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :5] = 0
    pos = (pad.cumsum(1) - 1).clamp(min=0)
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
            assert torch.equal(out, want), ctx.__name__
            ref = ref_model(input_ids=ids12, attention_mask=pad, position_ids=pos).logits
            s = shard_batch((ids12, pad, pos), mesh)
            got = unshard_batch(model(input_ids=s[0], attention_mask=s[1], position_ids=s[2]).logits, mesh)
            assert rel_err(got[pad.bool()], ref[pad.bool()]) <= TOL, ctx.__name__
            hpos = torch.arange(12).expand(2, 12)
            href = hybrid_base(input_ids=ids12, position_ids=hpos).logits
            hs = shard_batch((ids12, hpos), mesh, layout="headtail")
            hgot = unshard_batch(hybrid(input_ids=hs[0], position_ids=hs[1]).logits, mesh, layout="headtail")
            assert rel_err(hgot, href) <= TOL, ctx.__name__
    plain = cp_dtensor.remove_context_parallel(hybrid)
    assert not any(hasattr(m, "_cp_dtensor_hf") or hasattr(m, "_cp_dtensor_token") for m in plain.modules())
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids12, position_ids=hpos).logits, href)


def _messages(rank: int, world: int, base, model, mesh) -> None:
    """Refusals say what the caller did and today's fix; the default cache kind is served."""
    ids, _ = _prompt(9)
    gen = lambda **kw: model.generate(input_ids=ids, max_new_tokens=3, **{**GREEDY, **kw})  # noqa: E731
    with torch.no_grad():
        want = copy.deepcopy(base).generate(input_ids=ids, max_new_tokens=3, **GREEDY)
        assert torch.equal(gen(cache_implementation="dynamic"), want)
        _expect("passed cache_implementation='static'.*static cache cannot be split.*Drop cache_implementation",
                lambda: gen(cache_implementation="static"))
        _expect("generate\\(\\) was passed use_cache=False.*Drop use_cache=False", lambda: gen(use_cache=False))
        model.generation_config.use_cache = False
        with pytest.raises(ValueError, match="model.generation_config sets use_cache=False") as e:
            gen()
        assert "Drop use_cache=False" not in str(e.value)
        model.generation_config.use_cache = True
        # a hand-written decode loop: pointed at generate()
        pos = torch.arange(12).expand(2, 12)
        s_ids, s_pos = shard_batch((ids[:, :12], pos), mesh)
        out = model(input_ids=s_ids, position_ids=s_pos, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        _expect("call model.generate", lambda: model(input_ids=nxt, position_ids=torch.full_like(nxt, 12),
                                                     past_key_values=out.past_key_values))
        assert torch.equal(gen(), want)  # still in step


def _check_habits(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    base, hybrid_base = _llama(), _hybrid()
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh)
    hybrid = hf.apply_context_parallel(copy.deepcopy(hybrid_base), mesh, layout="headtail")
    start = time.perf_counter()
    _stopping(rank, world, base, model)
    _sampling(rank, world, base, model)
    _copies(rank, world, base, model, mesh)
    _own_model(rank, world, mesh)
    _unsharded(rank, world, base, model, hybrid, mesh)
    _inference_mode(rank, world, base, model, hybrid_base, hybrid, mesh)
    _messages(rank, world, base, model, mesh)
    return time.perf_counter() - start


@pytest.mark.parametrize("world", [2, 3])
def test_generate_and_evaluation_habits(world):
    """The five habits of issue #37 and the refusals' messages, each against CP=1 on every rank."""
    run_ranks(world, _check_habits)
