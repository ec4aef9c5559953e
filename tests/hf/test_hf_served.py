"""The transformers door's allowlist (hf/served.py, Note [The transformers door's allowlist]): every family on
it equals the model without cp_dtensor -- tiled head and loss against the untiled model at CP=1, context
parallelism at P=2 against the plain model on the full batch -- and every model or config off it is refused with
a ValueError on every rank, before the model changes or anything is communicated."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from _conformance import tiny_config
from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import transformers as T  # noqa: E402

from cp_dtensor.core.batch import shard_batch  # noqa: E402
from cp_dtensor.doors import reduce_gradients  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf.served import CP_FAMILIES, TILED_FAMILIES  # noqa: E402
from cp_dtensor.hf.tiling import apply_sequence_tiling  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # issue 48's bars: relative (grads: to the largest magnitude)
N, V, B = 24, 64, 2
TINY = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, attn_implementation="sdpa")
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
GEMMA = dict(final_logit_softcapping=None, attn_logit_softcapping=None, attn_implementation="eager")
FAMILIES = {  # model_type: (config class, model class, extra config); every TILED_FAMILIES / CP_FAMILIES entry
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=9)),
    "ministral": (T.MinistralConfig, T.MinistralForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {}),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=16)),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(GEMMA, sliding_window=9)),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA, sliding_window=9)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {}),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, dict(residual_multiplier=0.5, embedding_multiplier=2.0,
                                                            logits_scaling=4.0)),  # scales: served tiled
    "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(logit_scale=0.0625)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, MOE),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(MOE, attn_implementation="eager")),
}
# the hybrids' entries: tested at CP=2 against CP=1 where their linear layers are (tests/hf/test_hf_linear.py,
# tests/hf/test_hf_hybrid_generate.py)
HYBRIDS = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "olmo_hybrid", "lara_mini", "bailing_hybrid"}


# the families the conformance sweep added to TILED_FAMILIES, at its tiny configs (tests/hf/_conformance.py)
SWEPT = ("deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen2_moe", "ernie4_5_moe", "dots1", "olmo3",
         "smollm3", "seed_oss", "apertus")
ROUTED = ("ernie4_5_moe", "minimax_m2", "qwen2_moe")  # their router losses, served under CP


def _model(kind: str, **extra):
    if kind in SWEPT:
        cfg = tiny_config(kind)
        for key, value in extra.items():
            setattr(cfg, key, value)
        torch.manual_seed(0)
        return getattr(T, TILED_FAMILIES[kind][0])(cfg).float().train()
    cfg_cls, cls, own = FAMILIES[kind]
    torch.manual_seed(0)
    return cls(cfg_cls(**{**TINY, **own, **extra})).float().train()


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, V, (B, N), generator=g), torch.randint(0, V, (B, N), generator=g)
    labels[0, :5] = -100
    return tokens, torch.arange(N).expand(B, N), labels


def _plain(kind: str) -> tuple[float, torch.Tensor]:
    """The model without cp_dtensor on the full batch: (loss, all gradients)."""
    model = _model(kind)
    tokens, positions, labels = _batch()
    count = (hf.shift_labels(labels) != -100).sum()
    out = model(input_ids=tokens, position_ids=positions, labels=labels, num_items_in_batch=count, use_cache=False)
    out.loss.backward()
    return out.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _compare(where: str, loss: float, grads: torch.Tensor, ref) -> None:
    assert abs(loss - ref[0]) <= LOSS_TOL * abs(ref[0]), f"{where}: loss {loss} vs {ref[0]}"
    assert grads.shape == ref[1].shape and rel_err(grads, ref[1]) <= GRAD_TOL, f"{where}: {rel_err(grads, ref[1]):.2e}"


def test_every_entry_has_a_test():
    """The families tested here by hand stay served; every other CP_FAMILIES entry is the conformance sweep's
    (tests/hf/test_hf_conformance.py), every other TILED_FAMILIES entry the tiling sweep's
    (tests/hf/test_hf_tiling_sweep.py)."""
    assert set(FAMILIES) | set(SWEPT) <= set(TILED_FAMILIES) <= CP_FAMILIES
    assert set(FAMILIES) | HYBRIDS | set(SWEPT) <= CP_FAMILIES
    for kind, (_, cls, _) in FAMILIES.items():
        assert cls.config_class.model_type == kind and (kind not in TILED_FAMILIES or TILED_FAMILIES[kind][0] == cls.__name__)


def test_tiled_families_equal_untiled():
    """Each family tested here at CP=1 (Granite with its multipliers and scale on): tiled head, loss and MLPs
    equal the untiled model (B = 2)."""
    tokens, positions, labels = _batch()
    count = (hf.shift_labels(labels) != -100).sum()
    for kind in (*FAMILIES, *SWEPT):
        ref = _plain(kind)
        model = apply_sequence_tiling(_model(kind), tile_size=5)
        out = model(input_ids=tokens, position_ids=positions, labels=labels, num_items_in_batch=count, use_cache=False)
        out.loss.backward()
        _compare(f"{kind} tiled", out.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                                if p.grad is not None]), ref)
    apply_sequence_tiling(_model("llama", loss_type="ForCausalLM"))  # the default loss, spelled out: tiled


def test_tiled_moe_router_loss_equals_untiled():
    """The MoE entries with the router loss on (output_router_logits, coefficient 0.5), with and without an
    attention_mask (left padding: the router loss's rows in [B * S] order): tiled loss, router loss, router
    logits and gradients equal the untiled model's (Note [Recorded router logits under tiling])."""
    tokens, positions, labels = _batch()
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, :4] = 0
    moe = ["gpt_oss", "mixtral", "qwen3_moe", *ROUTED]
    assert all("output_router_logits" in TILED_FAMILIES[kind][1] for kind in moe)
    for kind in moe:
        for attention_mask in (None, mask):
            kw = dict(input_ids=tokens, position_ids=positions, labels=labels, attention_mask=attention_mask,
                      use_cache=False, output_router_logits=True)
            runs = []
            for tile in (None, 5):
                model = _model(kind, router_aux_loss_coef=0.5)
                out = (model if tile is None else apply_sequence_tiling(model, tile_size=tile))(**kw)
                out.loss.backward()
                runs.append((out.loss.item(), out.aux_loss.item(), out.router_logits,
                             torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
            (loss, aux, routers, grads), ref = runs[1], runs[0]
            where = f"{kind} tiled, mask {attention_mask is not None}"
            _compare(where, loss, grads, (ref[0], ref[3]))
            assert abs(aux - ref[1]) <= LOSS_TOL * abs(ref[1]) and ref[1] > 0, f"{where}: router loss {aux} vs {ref[1]}"
            assert len(routers) == len(ref[2]) >= 1 and all(r.shape == (B * N, 4) and rel_err(r, q) <= 1e-6
                                                            for r, q in zip(routers, ref[2])), where


class _OwnLossForCausalLM(T.LlamaForCausalLM):
    """A model that computes its own loss (a z-loss from the logits), as remote code does."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        logits = out.logits.float()
        if labels is not None:
            out.loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()) \
                + 1e-3 * logits.logsumexp(-1).pow(2).mean()
        return out


def _refusals(rank: int, world: int) -> dict:
    """Every refusal on every rank: nothing communicated (no collective is issued), the model unchanged."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    llama = dict(TINY, attn_implementation="sdpa")
    tiling = {  # (model, the words its error names)
        "logits_soft_cap": (_model("llama", logits_soft_cap=30.0), "logits_soft_cap"),
        "output_logit_soft_cap": (_model("llama", output_logit_soft_cap=30.0), "output_logit_soft_cap"),
        "unpadded_vocab_size": (_model("llama", unpadded_vocab_size=V - 8), "unpadded_vocab_size"),
        "z_loss": (_model("llama", z_loss_weight=1e-4), "z_loss_weight"),
        "gemma2 softcap": (_model("gemma2", final_logit_softcapping=30.0), "final_logit_softcapping"),
        "own loss": (_OwnLossForCausalLM(T.LlamaConfig(**llama)), "overrides"),
        "opt (not listed)": (T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                                           num_attention_heads=4, word_embed_proj_dim=32)),
                             "not one of them"),
    }
    for case, (model, words) in tiling.items():
        for door in (lambda m: hf.apply_context_parallel(m, mesh, sequence_tiling=True),
                     lambda m: apply_sequence_tiling(m, tile_size=8)):
            with pytest.raises(ValueError, match=words) as err:
                door(model)
            assert "sequence_tiling" in str(err.value), case
            assert model.config._attn_implementation != hf.NAME and not hasattr(model, "_cp_dtensor_tiling"), case
        out[case] = True
    ok = _model("llama", logits_soft_cap=30.0)  # the same config under CP alone: Llama's code never reads it
    hf.apply_context_parallel(ok, mesh)
    conv = _model("llama")
    conv.model.layers[0].conv = nn.Conv1d(32, 32, 3)  # a part the family does not have
    wpe = _model("llama")
    wpe.model.wpe = nn.Embedding(128, 32)
    cp = {
        "gpt2 (learned positions)": (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4)),
                                     "model_type 'gpt2'"),
        "opt (learned positions)": (T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                                  ffn_dim=64, num_attention_heads=4,
                                                                  word_embed_proj_dim=32)), "model_type 'opt'"),
        "mamba (no attention)": (T.MambaForCausalLM(T.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                                   state_size=4)), "model_type 'mamba'"),
        "bert (learned positions, bidirectional)": (T.BertLMHeadModel(T.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
            is_decoder=True)), "model_type 'bert'"),
        "axk2 (sparse attention, not a served DSA family)": (T.AXK2ForCausalLM(tiny_config("axk2")),
                                                             "indexed_attention layers .* DeepSeek Sparse Attention"),
        "llama + conv": (conv, r"layers\.0\.conv is a Conv1d"),
        "llama + wpe": (wpe, r"model\.wpe is a Embedding"),
    }
    for case, (model, words) in cp.items():
        with pytest.raises(ValueError, match=words) as err:
            hf.apply_context_parallel(model, mesh)
        assert "without CP" in str(err.value), case
        assert getattr(model.config, "_attn_implementation", None) != hf.NAME, case
        out[case] = True
    return out


def test_refused_on_every_rank():
    results = run_ranks(2, _refusals)
    assert results[0] == results[1] and all(results[0].values()) and len(results[0]) == 14


def _cp_families(rank: int, world: int) -> list[str]:
    """Each FAMILIES entry at CP=2 (layout headtail, packed rows as two documents in row 1) equals the plain
    model on the full batch: loss and all gradients."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    done = []
    for kind in FAMILIES:
        ref = _plain(kind)
        model = hf.apply_context_parallel(_model(kind), mesh, layout="headtail")
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout="headtail")
        res = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                    use_cache=False)
        res.loss.backward()
        reduce_gradients(model, mesh)
        total = res.loss.detach().clone()
        torch.distributed.all_reduce(total)
        _compare(f"{kind} CP={world}", total.item(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                                  if p.grad is not None]), ref)
        done.append(kind)
    return done


def test_cp_families_equal_plain():
    assert run_ranks(2, _cp_families) == [list(FAMILIES)] * 2


def _router_loss(rank: int, world: int) -> list[str]:
    """An MoE training call with its router loss on (config or call) under CP, tiled or not: the ranks' losses and
    aux_loss shares sum to the plain model's, and the gradients summed over the ranks are its (Note [Router loss
    under CP] in hf/router.py); without labels (evaluation) it runs too."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout="headtail")
    kw = dict(input_ids=tok, position_ids=pos, use_cache=False)
    train = dict(kw, labels=lab, shift_labels=lab, num_items_in_batch=count)
    served = []
    for kind in ("gpt_oss", "mixtral", "qwen3_moe", *ROUTED):
        plain = _model(kind, output_router_logits=True, router_aux_loss_coef=0.5)
        want = plain(input_ids=tokens, position_ids=positions, labels=labels, num_items_in_batch=count, use_cache=False)
        want.loss.backward()
        want_grads = torch.cat([p.grad.flatten() for p in plain.parameters() if p.grad is not None])
        for tiled, in_call in ((False, False), (True, True)):
            model = _model(kind, router_aux_loss_coef=0.5, **({} if in_call else {"output_router_logits": True}))
            model = hf.apply_context_parallel(model, mesh, layout="headtail", sequence_tiling=4 if tiled else False)
            out = model(**train, **({"output_router_logits": True} if in_call else {}))
            out.loss.backward()
            got = torch.stack([out.loss.detach(), out.aux_loss.detach()])
            torch.distributed.all_reduce(got)
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            torch.distributed.all_reduce(grads)
            assert abs(float(got[0]) - want.loss.item()) < 1e-5, (kind, tiled, float(got[0]), want.loss.item())
            assert abs(float(got[1]) - want.aux_loss.item()) < 1e-5, (kind, tiled)
            assert (grads - want_grads).abs().max() < 1e-4, (kind, tiled)
            assert model(**kw, output_router_logits=True).aux_loss is not None
            served.append(kind)
    return served


def _family_dropout(rank: int, world: int) -> list[str]:
    """A family whose default config turns attention dropout on (Seed-OSS: attention_dropout=0.1): a training call
    under CP raises on every rank, naming the config key; evaluation runs, and so does training with it at 0."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout="headtail")
    train = dict(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, use_cache=False,
                 num_items_in_batch=(shifted != -100).sum())
    seen = []
    for dropout in (None, 0.0):
        torch.manual_seed(0)
        extra = {} if dropout is None else dict(attention_dropout=dropout)
        model = hf.apply_context_parallel(T.SeedOssForCausalLM(T.SeedOssConfig(**TINY, **extra)), mesh,
                                          layout="headtail").train()
        if dropout is None:
            assert model.config.attention_dropout == 0.1  # the family's default
            with pytest.raises(ValueError, match=r"config\.attention_dropout = 0"):
                model(**train)
            seen.append("refused")
            model.eval()
        seen.append(f"{model(**train).loss.item() > 0}")
    return seen


def test_family_default_attention_dropout_refused_naming_the_key():
    assert run_ranks(2, _family_dropout) == [["refused", "True", "True"]] * 2


def test_router_loss_served_under_cp():
    kinds = ("gpt_oss", "mixtral", "qwen3_moe", *ROUTED)
    assert run_ranks(2, _router_loss) == [[k for k in kinds for _ in range(2)]] * 2


def test_tiled_logits_raise_when_read():
    """A tiled training call's logits slot (dict or return_dict=False tuple) is [B, N, 0] and raises when read;
    the tuple is the dict's values in order (loss first); eval calls return the real logits."""
    tokens, positions, labels = _batch()
    kw = dict(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
    ref_model = _model("llama")
    ref = ref_model(**kw).loss.item()
    model = apply_sequence_tiling(_model("llama"), tile_size=7)
    as_dict = model(**kw)
    as_tuple = model(**kw, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(as_dict.to_tuple())
    for logits, loss in ((as_dict.logits, as_dict.loss), (as_dict["logits"], as_dict["loss"]),
                         (as_tuple[1], as_tuple[0])):
        assert abs(loss.item() - ref) <= LOSS_TOL * abs(ref) and logits.shape == (B, N, 0)
        assert logits.detach().clone().float().shape == (B, N, 0) and "never computed" in repr(logits)
        reads = (lambda x: x.view(-1, V), lambda x: x[:, :-1], lambda x: x.float().softmax(-1), lambda x: x.argmax(-1),
                 lambda x: nn.functional.cross_entropy(x.flatten(0, 1), labels.flatten()), lambda x: x.sum(),
                 lambda x: torch.isinf(x), bool)
        for read in reads:  # a compute_loss override reading outputs.logits: the error, not inf or nan
            with pytest.raises(ValueError, match="never computed: sequence_tiling"):
                read(logits)
    # a compiled frame that meets the slot (DDP's post-forward under Trainer(torch_compile=True)) reads only its
    # metadata: it passes through, and still raises when read
    passed = torch.compile(lambda loss, x: (loss * 2, x) if x.grad_fn is None else (loss, x), backend="eager")(
        as_dict.loss, as_dict.logits)[1]
    assert isinstance(passed, type(as_dict.logits)) and passed.shape == (B, N, 0)
    with pytest.raises(ValueError, match="never computed: sequence_tiling"):
        passed.sum()
    model.eval()
    with torch.no_grad():
        assert rel_err(model(**kw).logits, ref_model.eval()(**kw).logits) <= 1e-5


def _float64_autocast(rank: int, world: int) -> float:
    """A float64 model under bf16 autocast at CP=2: as at CP=1 (autocast leaves float64 alone)."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    plain = _model("llama").double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(input_ids=tokens, position_ids=positions, labels=labels, num_items_in_batch=count,
                     use_cache=False).loss
        model = hf.apply_context_parallel(_model("llama").double(), mesh)
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout="striped")
        loss = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                     use_cache=False).loss
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    assert loss.dtype == want.dtype and abs(total.item() - want.item()) <= 1e-6 * abs(want.item()), (total, want)
    return total.item()


def test_float64_under_autocast_as_at_cp1():
    assert len(set(run_ranks(2, _float64_autocast))) == 1


def _own_loss_trainer(rank: int, world: int, out_dir: str) -> str:
    from datasets import Dataset

    class OwnLoss(T.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            logits = out.logits[:, :-1].flatten(0, 1)  # the override's own cross-entropy
            return nn.functional.cross_entropy(logits, inputs["labels"][:, 1:].flatten())

    tokens = _batch()[0]
    data = Dataset.from_list([{"input_ids": row.tolist(), "labels": row.tolist()} for row in tokens])
    args = T.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to=[],
                               use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = OwnLoss(model=apply_sequence_tiling(_model("llama"), tile_size=8), args=args, train_dataset=data)
    try:
        trainer.train()
    except ValueError as e:
        return str(e)
    return "trained"


def test_trainer_compute_loss_reading_tiled_logits_raises(tmp_path):
    """A Trainer whose compute_loss reads outputs.logits of a tiled model stops with the tiling's error (it
    trained on inf before, logged as 0.0). In a forked process: a Trainer's AcceleratorState is process-wide
    and would leak into later tests' ranks."""
    assert "never computed: sequence_tiling" in run_ranks(1, _own_loss_trainer, str(tmp_path))[0]
