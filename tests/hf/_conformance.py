"""The conformance sweep of the transformers door (tests/hf/test_hf_conformance.py, scripts/hf_conformance.py):
every ``...ForCausalLM`` family of the installed transformers, as a tiny random fp32 model, run at CP=P against
the same model at CP=1 -- loss, logits, every gradient, one greedy generate() -- with the door's allowlist
lifted for the family under test. What passes is what cp_dtensor/hf/families.py lists as served.

Each family gets one verdict: ``served``, or why not (the door's own refusal, a difference from CP=1, or a
model the sweep cannot build). The static part (build the model, the door's model checks) runs in the calling
process; only the families that pass it go to the ranks, all in one spawn.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import warnings

import torch

from _dist import RankFailure, run_ranks
from _ref import rel_err

V, B, N, PROMPT, NEW = 64, 2, 24, 12, 3  # N: a multiple of 2P for P = 2, 3 (headtail)
TOL = 1e-5  # loss, logits and all gradients together: relative to the largest magnitude
LINEAR_TOL = 1e-4  # models with linear-attention layers: tests/hf/test_hf_linear.py's fp32 bar (its Note [fp32
# precision with the checkpoints' decays]: the chunked delta rule's gradients keep fewer digits at CP=1 itself)
TINY = dict(  # every key a family's config has is set; the rest are ignored
    vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    n_shared_experts=1, shared_expert_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
    num_expert_group=1, rotary_dim=4,
    moe_num_experts=4, moe_k=2, moe_intermediate_size_shared=16, num_shared_experts=1, moe_topk=2,
    # MLA: the value head (8) unlike the query's (nope 8 + rope 4)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=12,
    # sparse attention's indexer
    index_n_heads=2, index_head_dim=8, index_topk=8,
    # other spellings of the sizes
    n_embd=32, n_layer=2, n_head=4, n_positions=128, d_model=32, n_layers=2, n_heads=4, ffn_dim=48,
    num_layers=2, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48, encoder_layers=1,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
)
# config keys whose nonzero value is a random part of a training call (dropout, router noise): off in the sweep,
# and the family's default reported when it is on
OWN = {  # a family's own sizes where TINY's do not fit it (the hybrids': as tests/hf/test_hf_linear.py's)
    "kimi_linear": dict(num_key_value_heads=4, linear_head_dim=16, linear_num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, mlp_layer_types=["dense"] * 2),
    "bailing_hybrid": dict(num_key_value_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=16,
                           first_k_dense_replace=2, num_mtp_layers=0),
}
UNSWEPT: dict[str, str] = {}  # families whose CP run cannot be swept in one spawn with the rest: the reason is the
# verdict (a run that makes a rank die would take the others' verdicts with it)
_NOISE = ("dropout", "jitter", "drop_rate", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def families() -> dict[str, str]:
    """model_type -> the ``...ForCausalLM`` class name, for every causal LM of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _noisy(key: str, value) -> bool:
    return any(n in key for n in _NOISE) and isinstance(value, (int, float)) and not isinstance(value, bool) \
        and value > 0


def noisy_defaults(kind: str) -> dict:
    """The family's default config entries that make training calls random (dropout, router jitter)."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[kind]()
    return {k: v for c in _all_configs(cfg) for k, v in sorted(c.to_dict().items()) if _noisy(k, v)}


def _all_configs(cfg) -> list:
    out = [cfg]
    for key in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out += _all_configs(sub)
    return out


def tiny_config(kind: str):
    """The family's config at tiny sizes, fp32 attention through sdpa (eager where sdpa is not offered), every
    dropout and router noise off, windows (where the family has them) shorter than the sequence."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[kind]
    default = cls().to_dict()
    kw = {k: v for k, v in TINY.items() if k in default}
    kw.update({k: 0.0 for k, v in default.items() if _noisy(k, v)})
    if "kv_lora_rank" in default:  # MLA: one key per query head; head_dim is the rotary part's
        kw.update(num_key_value_heads=TINY["num_attention_heads"], head_dim=TINY["qk_rope_head_dim"])
    if "linear_attention" in (default.get("layer_types") or ()):  # a hybrid: one linear layer, then attention
        kw["layer_types"] = ["linear_attention", "full_attention"]
    kw.update(OWN.get(kind, {}))
    if default.get("sliding_window"):
        kw["sliding_window"] = 9
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # the ring has no soft cap
        if key in default:
            kw[key] = None
    cfg = cls(**kw)
    for c in _all_configs(cfg)[1:]:  # sub-configs keep their own defaults: size them too
        for k, v in TINY.items():
            if k in c.to_dict() and not isinstance(getattr(c, k, None), (list, dict)):
                setattr(c, k, v)
    return cfg


def build(kind: str, cls_name: str):
    """(the tiny model at CP=1, its attention implementation), seeded: the same weights in every process."""
    import transformers

    cls = getattr(transformers, cls_name)
    cfg = tiny_config(kind)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(cfg).float()
    impl = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    try:
        model.set_attn_implementation(impl)
    except (ValueError, ImportError):
        impl = "eager"
        model.set_attn_implementation(impl)
    return model.train(), impl


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, V, (B, N), generator=g)
    labels = tokens.clone()
    labels[0, :5] = -100
    return tokens, torch.arange(N).expand(B, N), labels


def static_verdict(kind: str, cls_name: str) -> tuple[str | None, object]:
    """(why not, before any rank runs -- None when the ranks should run it; the model at CP=1 or None)."""
    from cp_dtensor.hf import served

    if kind in UNSWEPT:
        return UNSWEPT[kind], None
    try:
        model, _ = build(kind, cls_name)
    except Exception as e:  # noqa: BLE001 -- the sweep reports every failure as the family's verdict
        return f"the sweep's tiny model was not built: {type(e).__name__}: {str(e).splitlines()[0][:160]}", None
    text = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return "an encoder-decoder model, not a text decoder", None
    if any(c.model_type in ("bert", "roberta") or getattr(c, "is_decoder", None) is False for c in _all_configs(
            model.config)) and "position_embedding_type" in model.config.to_dict():
        return "a bidirectional encoder (learned absolute positions), not a text decoder", None
    kinds = {getattr(c, "model_type", None) for c in _all_configs(model.config)}
    saved = served.CP_FAMILIES
    served.CP_FAMILIES = saved | kinds  # the door's allowlist lifted for this family: the sweep decides
    try:
        types = served.layer_types(model)
        linear = []
        if "linear_attention" in types:
            from cp_dtensor.hf.linear import linear_layers

            linear = [m for m, _ in linear_layers(model, "headtail")]
        err = served.cp_error(model, linear)
    except (ValueError, ImportError) as e:
        err = str(e)
    finally:
        served.CP_FAMILIES = saved
    if err is not None:
        for cut in (", which under context parallelism", "; context parallelism runs", " of the kinds context"):
            err = err.split(cut)[0]
        return "refused at the door: " + err[:240], None
    return None, model


def _sharded_run(model, kinds, mesh, world):
    import cp_dtensor
    from cp_dtensor.doors import reduce_gradients
    from cp_dtensor.hf import attention as hf
    from cp_dtensor.hf import served

    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    saved = served.CP_FAMILIES
    served.CP_FAMILIES = saved | kinds
    try:
        cp = hf.apply_context_parallel(model, mesh, layout="headtail")
    finally:
        served.CP_FAMILIES = saved
    tok, pos, lab = cp_dtensor.shard_batch((tokens, positions, shifted), mesh, layout="headtail")
    out = cp(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count, use_cache=False)
    out.loss.backward()
    reduce_gradients(cp, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    logits = cp_dtensor.unshard_batch(out.logits.detach().float().contiguous(), mesh, layout="headtail")
    return cp, loss, logits


def _plain_run(model):
    tokens, positions, labels = _batch()
    out = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach().float()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _generate(model):
    ids = torch.randint(3, V, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model.eval().generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                     eos_token_id=None)[0, PROMPT:].tolist()


def compare(kind: str, plain, mesh, world: int) -> str:
    """'served' or what differs, for one family at CP=world (plain: the model at CP=1, untouched)."""
    model = copy.deepcopy(plain)
    ref_loss, ref_logits = _plain_run(plain)
    kinds = {getattr(c, "model_type", None) for c in _all_configs(plain.config)}
    cp, loss, logits = _sharded_run(model, kinds, mesh, world)
    worst = {"losses": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "logits": rel_err(logits, ref_logits)}
    ref_grads, grads = _grads(plain), _grads(cp)
    if set(ref_grads) != set(grads):
        return f"CP={world}: gradients of {sorted(set(ref_grads) ^ set(grads))[:3]} missing"
    names = sorted(ref_grads)
    worst["gradients"] = rel_err(torch.cat([grads[n].flatten() for n in names]),
                                 torch.cat([ref_grads[n].flatten() for n in names]))
    linear = any("linear_attention" in (getattr(c, "layer_types", None) or ()) for c in _all_configs(plain.config))
    tol = LINEAR_TOL if linear else TOL
    bad = {k: v for k, v in worst.items() if not v <= tol}
    if bad:
        k = next(iter(bad))
        return f"CP={world}: the {k} are {bad[k]:.1e} off CP=1's (relative to the largest; the bar is {tol:.0e})"
    want, got = _generate(plain), _generate(cp)
    if want != got:
        return f"CP={world}: generate() tokens {got} differ from CP=1's {want}"
    return "served"


def _sweep_ranks(rank: int, world: int, todo: list[tuple[str, str]]) -> dict[str, str]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind, cls_name in todo:
        if os.environ.get("CP_CONFORMANCE_VERBOSE"):
            print(f"[rank {rank}] {kind}", file=sys.stderr, flush=True)
        _, plain = static_verdict(kind, cls_name)
        try:
            out[kind] = compare(kind, plain, mesh, world)
        except Exception as e:  # noqa: BLE001 -- raised alike on every rank (the door's checks agree first)
            out[kind] = f"CP={world}: {type(e).__name__}: {str(e).splitlines()[0][:240]}"
    return out


def sweep(worlds=(2, 3), only: list[str] | None = None) -> dict[str, str]:
    """model_type -> 'served' or why not, for every causal LM family (or ``only`` those), at every CP size."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    verdicts, todo = {}, []
    for kind, cls_name in families().items():
        if only is not None and kind not in only:
            continue
        why, _ = static_verdict(kind, cls_name)
        if why is None:
            todo.append((kind, cls_name))
        else:
            verdicts[kind] = why
    for world in worlds:
        try:
            got = run_ranks(world, _sweep_ranks, todo, timeout=900)[0]
        except RankFailure as e:  # a rank died (gloo aborts on collectives that differ across ranks)
            raise RankFailure(f"the sweep at CP={world} lost a rank; CP_CONFORMANCE_VERBOSE=1 names the family it ran "
                              f"last: give it a verdict in UNSWEPT (tests/hf/_conformance.py).\n{e}") from None
        for kind, verdict in got.items():
            if verdicts.get(kind, "served") == "served":
                verdicts[kind] = verdict
    importlib.invalidate_caches()
    return dict(sorted(verdicts.items()))


def with_notes(verdicts: dict[str, str]) -> dict[str, str]:
    """The verdicts, each served family's with what its default config turns on that CP refuses or changes."""
    out = {}
    for kind, verdict in verdicts.items():
        noisy = noisy_defaults(kind) if verdict == "served" else {}
        attention = {k: v for k, v in noisy.items() if "attention" in k or "attn" in k}
        notes = []
        if attention:
            notes.append("default " + ", ".join(f"{k}={v}" for k, v in attention.items()) + " is refused in training "
                         "under CP: set " + ", ".join(f"config.{k}=0" for k in attention))
        other = {k: v for k, v in noisy.items() if k not in attention}
        if other:
            notes.append("default " + ", ".join(f"{k}={v}" for k, v in other.items()) + ": random per rank, as at "
                         "CP=1 (not bit-equal to a CP=1 run)")
        out[kind] = "; ".join([verdict, *notes])
    return out


def render_list(verdicts: dict[str, str], version: str) -> str:
    """cp_dtensor/hf/families.py's text for ``verdicts`` (model_type -> verdict) swept on transformers ``version``."""
    rows = "\n".join(f"    {kind!r}: {verdict!r}," for kind, verdict in sorted(verdicts.items()))
    return (f'"""The transformers families context parallelism serves: every ``...ForCausalLM`` family of transformers\n'
            f"{version}, with the conformance sweep's verdict -- ``served`` (CP=2 and CP=3 equal CP=1: loss, logits\n"
            f'and gradients within 1e-5 -- 1e-4 with linear-attention layers -- generate() tokens identical) or why\n'
            "not. Generated by ``python scripts/hf_conformance.py`` (tests/hf/_conformance.py); do not edit by\n"
            "hand. hf/served.py's allowlist is the served entries.\n"
            "See Note [The transformers door's allowlist] in hf/served.py.\n"
            f'"""\n\nTRANSFORMERS = {version!r}  # the version swept\n'
            f"VERDICTS: dict[str, str] = {{  # noqa: E501\n{rows}\n}}\n")


BEGIN, END = "<!-- families: begin (python scripts/hf_conformance.py --table) -->", "<!-- families: end -->"


def render_table(verdicts: dict[str, str], version: str) -> str:
    """docs/transformers.md's table of families, between BEGIN and END."""
    served = [k for k, v in verdicts.items() if v.startswith("served")]
    lines = [BEGIN, "",
             f"{len(served)} of the {len(verdicts)} causal LM families of transformers {version} are served at the CP "
             "door; each was run as a tiny random fp32 model at CP=2 and CP=3 (headtail) against CP=1: loss, logits "
             "and gradients within 1e-5 (relative to the largest; 1e-4 for the hybrids' linear-attention layers), "
             "one greedy `generate()` token for token.", "",
             "| `model_type` | CP | why not, or what to change |", "|---|---|---|"]
    for kind in sorted(verdicts, key=lambda k: (not verdicts[k].startswith("served"), k)):
        verdict = verdicts[kind]
        ok = verdict.startswith("served")
        note = verdict[len("served"):].lstrip("; ") if ok else verdict
        note = note.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{kind}` | {'served' if ok else 'refused'} | {note} |")
    return "\n".join([*lines, "", END])
