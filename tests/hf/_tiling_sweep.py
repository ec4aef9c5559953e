"""The tiling sweep of the transformers door (tests/hf/test_hf_tiling_sweep.py, scripts/hf_tiling_sweep.py): every
family the conformance sweep serves at the CP door (cp_dtensor/hf/families.py), as the same tiny random fp32
model, run with sequence tiling (5-token tiles: several a row, the last one short) against the untiled model --
the loss and every gradient, and with the MoE router loss on (and a left-padded row) where the family's config
has one -- with the door's tiling allowlist lifted for the family under test. What passes is what
cp_dtensor/hf/tiled_families.py lists as served.

The tiled path is the same with and without CP (``apply_context_parallel(sequence_tiling=)`` applies
``apply_sequence_tiling`` once the ring is in; under CP the loss gets the globally shifted labels as
``shift_labels``), so one process at CP=1 runs it twice: with ``labels`` (transformers' in-row shift) and with
``shift_labels`` given, as under CP.

Each family gets one verdict: ``served``, or why not -- the tiling door's own refusal (a config key that may
touch the logits or the loss, a head that is not nn.Linear's forward), the tiled loss's refusal (the family's
forward hands its loss something other than the head's output: a soft cap, a scale the door does not know), or a
difference from the untiled model.
"""

from __future__ import annotations

import copy
import warnings

import torch

import _conformance
from _conformance import B, N, V, _all_configs, families, tiny_config
from _ref import rel_err

TILE = 5  # N = 24 tokens: five tiles a row, the last of 4
TOL = 1e-5  # the loss (relative) and every gradient (relative to the largest magnitude): the conformance sweep's bars
LINEAR_TOL = _conformance.LINEAR_TOL  # with linear-attention layers (the chunked delta rule keeps fewer digits at CP=1 itself)
SIZES = {"longcat_flash": dict(ffn_hidden_size=48, expert_ffn_hidden_size=16, zero_expert_num=2)}  # 73M params else
ROUTER_COEF = 0.5
SCALE = 0.5  # a served scale key's value in the sweep (a factor the tiled loss must carry exactly)


def cp_served() -> list[str]:
    """The families the conformance sweep serves at the CP door, which the tiling sweep runs."""
    from cp_dtensor.hf import families as cp_list

    return sorted(kind for kind, verdict in cp_list.VERDICTS.items() if verdict.startswith("served"))


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _router_key(key: str) -> bool:
    return key == "output_router_logits" or "aux_loss_coef" in key


def build(kind: str, cls_name: str, *, router: bool = False, config: dict | None = None):
    """(the conformance sweep's tiny model, the config keys matching the door's _LOGIT_KEYS it set to a value other
    than the default). Every numeric such key is moved off its default (a key on the way from the head to the loss
    would show): a scale the family's logits take (LOGIT_SCALES) to SCALE, any other to half its value (0.5 for 0 and
    1); with ``router`` the router loss is on (coefficient ROUTER_COEF). ``config``: entries set last."""
    import transformers

    from cp_dtensor.hf import served

    cfg = tiny_config(kind)
    scale = served.LOGIT_SCALES.get(kind, (None,))[0]
    moved = set()
    for c in _all_configs(cfg):
        for key, value in c.to_dict().items():
            if not served._LOGIT_KEYS.search(key) or key in served.TILED_RULES.get(kind, {}):
                continue
            if router and _router_key(key):
                setattr(c, key, True if key == "output_router_logits" else ROUTER_COEF)
                moved |= {key} - {"output_router_logits"}
            elif key == scale:
                setattr(c, key, SCALE)
            elif _numeric(value):
                setattr(c, key, 0.5 if value in (0, 1) else value / 2)
                moved.add(key)
    for key, value in {**SIZES.get(kind, {}), **(config or {})}.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, cls_name)(cfg).float()
    impl = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    try:
        model.set_attn_implementation(impl)
    except (ValueError, ImportError):
        model.set_attn_implementation("eager")
    return model.train(), tuple(sorted(moved))


def has_router(kind: str) -> bool:
    from transformers import CONFIG_MAPPING

    return any("output_router_logits" in c.to_dict() for c in _all_configs(CONFIG_MAPPING[kind]()))


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(3, V, (B, N), generator=g), torch.randint(3, V, (B, N), generator=g)
    labels[0, :5] = -100  # a prompt
    labels[1, 13] = -100
    return tokens, torch.arange(N).expand(B, N), labels


def _run(model, *, cp_labels: bool, padded: bool = False):
    """(loss, router loss or None, {name: gradient}) of one training call with the global token count; with
    ``cp_labels`` the call has the shape a CP rank's has: ``labels`` and ``shift_labels`` both the shifted labels;
    with ``padded`` an attention_mask left-pads the second row (the router loss counts only its 1 tokens, rows in
    [B * S] order: Note [Recorded router logits under tiling])."""
    from cp_dtensor.hf.attention import shift_labels

    tokens, positions, labels = _batch()
    shifted = shift_labels(labels)
    kw = dict(labels=shifted, shift_labels=shifted) if cp_labels else dict(labels=labels)
    if padded:
        kw["attention_mask"] = torch.ones(B, N, dtype=torch.long)
        kw["attention_mask"][1, :4] = 0
    out = model(input_ids=tokens, position_ids=positions, num_items_in_batch=(shifted != -100).sum(), use_cache=False,
                **kw)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    aux = None if aux is None else aux.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), None if aux is None else aux.item(), grads


def _differs(ref, got, where: str, tol: float) -> str | None:
    (loss0, aux0, grads0), (loss1, aux1, grads1) = ref, got
    if abs(loss1 - loss0) > tol * abs(loss0):
        return f"{where}: the loss {loss1:.8g} differs from the untiled {loss0:.8g}"
    if (aux0 is None) != (aux1 is None) or (aux0 is not None and abs(aux1 - aux0) > tol * abs(aux0)):
        return f"{where}: the router loss {aux1} differs from the untiled {aux0}"
    if set(grads0) != set(grads1):
        return f"{where}: gradients of {sorted(set(grads0) ^ set(grads1))[:3]} missing"
    names = sorted(grads0)
    err = rel_err(torch.cat([grads1[n].flatten() for n in names]), torch.cat([grads0[n].flatten() for n in names]))
    if not err <= tol:
        worst = max(names, key=lambda n: (grads1[n] - grads0[n]).abs().max().item())
        return f"{where}: the gradients are {err:.1e} off the untiled ones (relative to the largest; worst: {worst})"
    return None


def compare(kind: str, cls_name: str, *, router: bool = False, config: dict | None = None,
            rules: dict | None = None) -> tuple[str, tuple[str, ...]]:
    """('served' or why not, the config keys proven) for one family (with ``router``: the router loss on), the
    tiling door's allowlist lifted for it with the rules the run proves (``rules``: these instead)."""
    from cp_dtensor.hf import served
    from cp_dtensor.hf.tiling import apply_sequence_tiling

    plain, keys = build(kind, cls_name, router=router, config=config)
    tiled = copy.deepcopy(plain)
    saved = served.TILED_FAMILIES  # lifted for this family while it runs (each tiled call checks it again)
    served.TILED_FAMILIES = {**saved, kind: (cls_name, served.tiled_rules(kind, keys, router) if rules is None
                                             else rules)}
    try:
        try:
            apply_sequence_tiling(tiled, tile_size=TILE)
        except ValueError as e:
            return "refused at the door: " + str(e).split(" Drop sequence_tiling")[0][:240], keys
        try:
            ref = _run(plain, cp_labels=False, padded=router)
        except Exception as e:  # noqa: BLE001
            return f"the untiled model raises {type(e).__name__}: {str(e).splitlines()[0][:200]}", keys
        if router and ref[1] is not None and not ref[1] > 0:
            return f"the router loss is {ref[1]} with output_router_logits on", keys
        linear = any("linear_attention" in (getattr(c, "layer_types", None) or ()) for c in _all_configs(plain.config))
        for cp_labels in (False, True):
            tiled.zero_grad(set_to_none=True)
            try:
                got = _run(tiled, cp_labels=cp_labels, padded=router)
            except Exception as e:  # noqa: BLE001 -- the sweep reports every failure as the family's verdict
                return f"tiled: {type(e).__name__}: {str(e).splitlines()[0][:240]}", keys
            why = _differs(ref, got, "tiled" + (", shift_labels" if cp_labels else ""), LINEAR_TOL if linear else TOL)
            if why is not None:
                return why, keys
        from cp_dtensor.hf.tiling import _mlps

        return "served" if _mlps(tiled) else "served; the head and loss tiled, no MLP (no base_model.layers[i].mlp)", keys
    finally:
        served.TILED_FAMILIES = saved


def default_notes(kind: str, rules: dict) -> list[str]:
    """What the family's default config turns on that its tiling rules refuse (a soft cap on the logits, ...)."""
    from transformers import CONFIG_MAPPING

    from cp_dtensor.hf import served

    out = []
    for c in _all_configs(CONFIG_MAPPING[kind]()):
        for key, value in sorted(c.to_dict().items()):
            if not served._LOGIT_KEYS.search(key) or value is None or value is False or key == "loss_type":
                continue
            rule = rules.get(key)
            if rule is served._ANY or rule is served._SCALE or (rule is not None and value in rule):
                continue
            off = "None" if value is not True else "False"
            out.append(f"default {key}={value!r} is refused tiled: set config.{key}={off}")
    return out


def verdict(kind: str, cls_name: str) -> tuple[str, tuple[str, ...], bool]:
    """(the family's verdict, the config keys proven, whether its router loss is served tiled)."""
    try:
        got, keys = compare(kind, cls_name)
    except Exception as e:  # noqa: BLE001
        return f"the sweep's tiny model did not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}", (), False
    if not got.startswith("served"):
        return got, keys, False
    notes, router = got.split("; ")[1:], False
    if has_router(kind):
        try:
            routed, proven = compare(kind, cls_name, router=True)
        except Exception as e:  # noqa: BLE001
            routed = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        router = routed.startswith("served")
        if router:
            keys = tuple(sorted(set(keys) | set(proven)))
        notes.append("output_router_logits=True served" if router else f"output_router_logits=True refused ({routed})")
    from cp_dtensor.hf import served

    notes += default_notes(kind, served.tiled_rules(kind, keys, router))
    return "; ".join(["served", *notes]), keys, router


def sweep(only: list[str] | None = None) -> tuple[dict[str, str], dict[str, str], dict[str, tuple], set[str]]:
    """(model_type -> verdict, the served families' causal LM class names, the config keys each proved, the
    families whose router loss is served), for every family the CP door serves (or ``only`` those)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    names = families()
    verdicts, classes, keys, routers = {}, {}, {}, set()
    for kind in cp_served():
        if only is not None and kind not in only:
            continue
        verdicts[kind], proven, router = verdict(kind, names[kind])
        if verdicts[kind].startswith("served"):
            classes[kind] = names[kind]
            if proven:
                keys[kind] = proven
        if router:
            routers.add(kind)
    return verdicts, classes, keys, routers


def render_list(verdicts: dict[str, str], classes: dict[str, str], keys: dict[str, tuple], routers: set[str],
                version: str) -> str:
    """cp_dtensor/hf/tiled_families.py's text, swept on transformers ``version``."""
    def rows(d):
        return "\n".join(f"    {k!r}: {v!r}," for k, v in sorted(d.items()))

    routed = "\n".join(f"    {k!r}," for k in sorted(routers))

    return (f'"""The transformers families sequence tiling serves: every family context parallelism serves\n'
            f"(hf/families.py) in transformers {version}, with the tiling sweep's verdict -- ``served`` (the tiled\n"
            "loss and every gradient within 1e-5 of the untiled model's, the router loss too where listed) or why\n"
            "not. Generated by ``python scripts/hf_tiling_sweep.py`` (tests/hf/_tiling_sweep.py); do not edit by\n"
            "hand. hf/served.py's TILED_FAMILIES is CLASSES with the rules of KEYS and ROUTER_LOSS.\n"
            "See Note [The transformers door's allowlist] in hf/served.py.\n"
            f'"""\n\nTRANSFORMERS = {version!r}  # the version swept\n'
            f"VERDICTS: dict[str, str] = {{  # noqa: E501\n{rows(verdicts)}\n}}\n"
            f"# the served families' causal LM classes\nCLASSES: dict[str, str] = {{\n{rows(classes)}\n}}\n"
            "# config keys matching the door's _LOGIT_KEYS the sweep ran off their defaults: read away from the head\n"
            f"KEYS: dict[str, tuple[str, ...]] = {{\n{rows(keys)}\n}}\n"
            "# the router loss (output_router_logits) proven tiled\n"
            f"ROUTER_LOSS: frozenset[str] = frozenset({{\n{routed}\n}})\n")


BEGIN, END = "<!-- tiled families: begin (python scripts/hf_tiling_sweep.py --table) -->", "<!-- tiled families: end -->"


def render_table(verdicts: dict[str, str], keys: dict[str, tuple], version: str) -> str:
    """docs/transformers.md's table of the tiled families, between BEGIN and END."""
    from cp_dtensor.hf import served as door

    served = [k for k, v in verdicts.items() if v.startswith("served")]
    lines = [BEGIN, "",
             f"{len(served)} of the {len(verdicts)} families served at the CP door in transformers {version} are "
             "served with sequence tiling; each was run as the conformance sweep's tiny random fp32 model, "
             f"{TILE}-token tiles of 24-token rows, against the untiled model: loss and every gradient within 1e-5 "
             "(relative to the largest; 1e-4 with linear-attention layers), with `labels` and with CP's "
             "`shift_labels`, every config key that may touch the logits run off its default, and again with "
             "`output_router_logits=True` and a left-padded row where the config has it (the router loss within "
             "1e-5 too).", "",
             "| `model_type` | tiled | config keys proven away from the head | what else |", "|---|---|---|---|"]
    for kind in sorted(verdicts, key=lambda k: (not verdicts[k].startswith("served"), k)):
        verdict = verdicts[kind]
        ok = verdict.startswith("served")
        note = (verdict[len("served"):].lstrip("; ") if ok else verdict).replace("|", "\\|").replace("\n", " ")
        if ok and kind in door.LOGIT_SCALES:
            key, op, _ = door.LOGIT_SCALES[kind]
            note = "; ".join(filter(None, [f"`logits {op} {key}` served (the logits' scale)", note]))
        if ok and kind in door.TILED_RULES:
            rules = ", ".join(f"`{k}`" + (" not on the head" if r is door._ANY else f" in {r}")
                              for k, r in door.TILED_RULES[kind].items())
            note = "; ".join(filter(None, [note, f"by hand: {rules}"]))
        proven = ", ".join(f"`{k}`" for k in keys.get(kind, ()))
        lines.append(f"| `{kind}` | {'served' if ok else 'refused'} | {proven} | {note} |")
    return "\n".join([*lines, "", END])
