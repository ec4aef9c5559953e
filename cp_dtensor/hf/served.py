"""What the transformers door serves: the model families context parallelism and sequence tiling are proven
exact for (an allowlist, a test per entry in tests/hf/test_hf_served.py); everything else is refused.

Note [The transformers door's allowlist]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A transformers model is arbitrary code: a denylist of the parts known to be wrong under CP ("refuse a
softcap named ``final_logit_softcapping``") misses every part it does not name -- a soft cap under
another config name, learned positions indexed by the local position, a recurrent layer that needs the
whole sequence -- and such a model runs, with a loss that is silently off. So the door serves what it
can prove equal to the model without cp_dtensor and refuses the rest, naming the part and what to use:

* **context parallelism** (``apply_context_parallel``): the model's ``config.model_type`` (and each
  sub-config's) is in ``CP_FAMILIES`` -- decoder families whose only sequence-mixing parts are attention
  through transformers' ``AttentionInterface`` (the ring replaces it), rotary positions computed from
  the global ``position_ids`` the door demands, and, for the hybrids, the linear-attention layers of
  hf/linear.py's FAMILIES; and no module of the model is a convolution, a recurrent cell or a second
  embedding table (learned positions indexed by the local position) outside those served linear
  layers -- a family's modeling code with a part added to it is not the family any more.
* **sequence tiling** of the head and loss (``sequence_tiling=``): the model's class is a family's
  ``...ForCausalLM`` in ``TILED_FAMILIES`` (a subclass only if it overrides no ``forward``), whose forward
  is ``loss_function(lm_head(hidden))`` with nothing between the head and the loss; and every config
  entry whose name could touch the logits or the loss (``_LOGIT_KEYS``: soft caps, scales, multipliers,
  z-loss, a sliced vocabulary, ...) is off (None / False) or one the family serves: a value that keeps
  its head plain, a scale of the logits (Granite's ``logits / logits_scaling``, Cohere's ``logits *
  logit_scale``: ``logits_factor``), or a key its code reads away from the head (Gemma 2's attention
  softcap, an MoE's router loss).

A scale is served exactly: the head is linear, so ``(h W^T + b) f = (h f) W^T + b f``. The scaled
tensor the family's forward hands its loss is ``h f`` (the head handed ``h`` through), so the tiled loss
takes it with the bias scaled by the same ``f`` (hf/tiling.py checks it is the head's tensor or one of
its shape, and puts TiledLogits in the output's slot that holds it).

Both checks read the model only: the same answer on every rank, raised at the door before anything is
changed or communicated.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["CP_FAMILIES", "TILED_FAMILIES", "cp_error", "layer_types", "logits_factor", "tiling_error"]

CP_FAMILIES = frozenset({  # attention through AttentionInterface + RoPE from position_ids (+ hf/linear.py's layers)
    "llama", "mistral", "ministral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3",
    "olmo2", "granite", "cohere", "mixtral", "gpt_oss",
    # hybrids: their linear_attention layers are hf/linear.py's FAMILIES
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "olmo_hybrid", "lara_mini", "bailing_hybrid",
})
_ANY = "not on the head"  # a key the family's code reads away from the head and the loss
_ROUTER = {"output_router_logits": _ANY, "router_aux_loss_coef": _ANY}  # MoE: the router's own logits and loss
_SCALE = "a number: the logits' scale"  # served by scaling the hidden states and bias instead: logits_factor
_GEMMA2 = {"final_logit_softcapping": (None,), "attn_logit_softcapping": _ANY}  # the head's cap only when None
TILED_FAMILIES: dict[str, tuple[str, dict]] = {  # model_type: (the causal LM class, config keys it serves)
    "llama": ("LlamaForCausalLM", {}), "mistral": ("MistralForCausalLM", {}), "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}), "gemma": ("GemmaForCausalLM", {}), "phi3": ("Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2ForCausalLM", {}), "ministral": ("MinistralForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", _GEMMA2), "gemma3_text": ("Gemma3ForCausalLM", _GEMMA2),
    "granite": ("GraniteForCausalLM", {"logits_scaling": _SCALE, "embedding_multiplier": _ANY,  # logits / scaling
                                       "residual_multiplier": _ANY, "attention_multiplier": _ANY}),
    "cohere": ("CohereForCausalLM", {"logit_scale": _SCALE}),  # logits * logit_scale
    "gpt_oss": ("GptOssForCausalLM", _ROUTER), "mixtral": ("MixtralForCausalLM", _ROUTER),
    "qwen3_moe": ("Qwen3MoeForCausalLM", _ROUTER),
}
# config names that could change the logits between the head and the loss, or the loss itself
_LOGIT_KEYS = re.compile(r"logit|soft_?cap|loss|unpadded_vocab|vocab_pad|multiplier|lm_head", re.IGNORECASE)
_SEQUENCE_MIXERS = (nn.modules.conv._ConvNd, nn.RNNBase, nn.RNNCellBase, nn.Embedding, nn.EmbeddingBag)
_NO_TILING = "Drop sequence_tiling (context parallelism alone serves it), or compute the loss yourself with " \
             "cp_dtensor.linear_cross_entropy(hidden, head.weight, labels, num_items_in_batch=...)."


def _configs(config) -> list:
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out += _configs(sub)
    return out


def layer_types(model: nn.Module) -> set[str]:
    """The model's ``config.layer_types`` (all sub-configs), or a ValueError when its family or a layer kind is
    not one context parallelism serves. See Note [The transformers door's allowlist]."""
    name, types = type(model).__name__, set()
    for config in _configs(model.config):
        kind = getattr(config, "model_type", None)
        if kind not in CP_FAMILIES:
            raise ValueError(
                f"context parallelism serves the transformers families whose sequence-mixing parts it splits exactly "
                f"(attention, rotary positions, the linear-attention layers of cp_dtensor.hf.linear); {name} is "
                f"model_type {kind!r}, not one of them ({', '.join(sorted(CP_FAMILIES))}): its recurrent or "
                "convolutional layers, or learned positions indexed by position, would see this rank's shard only. "
                "Run it without CP. (Note [The transformers door's allowlist] in cp_dtensor/hf/served.py)")
        types |= set(getattr(config, "layer_types", None) or ())
    other = sorted(types - {"full_attention", "sliding_attention", "linear_attention"})
    if other:
        raise ValueError(f"{name} has {', '.join(other)} layers (config.layer_types); context parallelism runs full "
                         "and sliding-window attention and the linear_attention layers of cp_dtensor.hf.linear.FAMILIES "
                         "(Gated DeltaNet, Kimi Delta Attention) only. Run it without CP.")
    return types


def cp_error(model: nn.Module, served_layers: list[nn.Module]) -> str | None:
    """Why context parallelism cannot serve ``model``'s modules (None: it can); ``served_layers``: its
    linear-attention layers that hf/linear.py serves. See Note [The transformers door's allowlist]."""
    name = type(model).__name__
    inside = {id(m) for layer in served_layers for m in layer.modules()}
    embeddings = model.get_input_embeddings()
    for path, m in model.named_modules():
        if isinstance(m, _SEQUENCE_MIXERS) and id(m) not in inside and m is not embeddings:
            what = "an embedding table besides the token embeddings (learned positions?)" \
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) else "a layer that mixes tokens along the sequence"
            return (f"{name}.{path} is a {type(m).__name__}: {what}, which under context parallelism would see this "
                    f"rank's shard only; the {model.config.model_type} family has no such part, so this model is not "
                    "the family context parallelism serves. Run it without CP.")
    return None


def logits_factor(model: nn.Module) -> float | None:
    """The number a served family multiplies its head's logits by before the loss (None: it hands the
    head's output on as it is). See Note [The transformers door's allowlist]."""
    kind = getattr(model.config, "model_type", None)
    if kind == "granite":
        return 1.0 / model.config.logits_scaling  # modeling_granite: logits / self.config.logits_scaling
    if kind == "cohere":
        return float(model.logit_scale)  # modeling_cohere: logits * self.logit_scale (set from the config)
    return None


def tiling_error(model: nn.Module) -> str | None:
    """Why ``model``'s head and loss cannot be tiled (None: they can). See Note [The transformers door's allowlist]."""
    name, kind = type(model).__name__, getattr(model.config, "model_type", None)
    entry = TILED_FAMILIES.get(kind)
    family = next((c for c in type(model).__mro__ if entry is not None and c.__name__ == entry[0]
                   and c.__module__.startswith("transformers.models.")), None)
    if family is None:
        return (f"sequence_tiling tiles the head and loss of the causal LMs whose forward is proven to be "
                f"loss_function(lm_head(hidden)) ({', '.join(c for c, _ in TILED_FAMILIES.values())}); {name} "
                f"(model_type {kind!r}) is not one of them: its forward may touch the logits or compute its own loss. "
                + _NO_TILING)
    mro = type(model).__mro__
    own = [c.__name__ for c in mro[:mro.index(family)] if "forward" in vars(c) or "loss_function" in vars(c)]
    if own:
        return (f"sequence_tiling cannot tile {name}'s head and loss: {own[0]} overrides {family.__name__}'s forward "
                f"or loss_function, which tiling would bypass. " + _NO_TILING)
    served = {"loss_type": (None, "ForCausalLM"), **entry[1]}  # loss_type: checked by hf/tiling.py's check_tileable
    for config in _configs(model.config):
        for key, value in sorted(config.to_dict().items()):
            if not _LOGIT_KEYS.search(key) or value is None or value is False:
                continue
            rule = served.get(key)
            if rule is _SCALE and isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
                continue
            if rule is _ANY or (rule is not None and value in rule and not isinstance(value, bool)):
                continue
            keeps = f"; {family.__name__} is tiled only with {key} in {rule}" if rule is not None else ""
            return (f"sequence_tiling cannot tile {name}'s head and loss: config.{key}={value!r} may change the "
                    f"logits or the loss between the LM head and the loss{keeps}. " + _NO_TILING)
    return None
