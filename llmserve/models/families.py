"""Which Hugging Face architectures run, each as one entry: how its config.json reads into the model description
(`ModelConfig`) and how its checkpoint names its tensors.

Every family runs on the one decoder (`models/decoder.py`); what differs is data. Adding one is a function that
reads its config's own fields and, where its tensors are named or fused differently from Llama's, a renaming
(`Family.rename`) applied as the checkpoint is read, so that everything after the loader sees Llama's names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmserve.models.config import ModelConfig, MoEConfig

# a tensor's new name, and the rows of the stored tensor it takes (None: all of them)
Renamed = list[tuple[str, slice | None]]


@dataclass(frozen=True)
class Family:
    architecture: str
    # the family's own fields, read from its config.json on top of what every family reads (`_common`)
    read: Callable[[dict, ModelConfig], ModelConfig] = lambda hf, cfg: cfg
    # a checkpoint tensor's name (without "model.") -> the Llama-named tensors it holds; None: its name as it is
    rename: Callable[[str, ModelConfig], Renamed] | None = None
    notes: dict[str, str] = field(default_factory=dict)


def _windows(hf: dict, cfg: ModelConfig, every_layer: bool) -> tuple[int, ...]:
    """Each layer's sliding window: transformers' `layer_types` where the config lists them; else, for a family
    whose window applies to every layer (`every_layer`, Mistral's), `sliding_window` on all; else Qwen2's rule
    (layers from max_window_layers on, where use_sliding_window). A window as long as the context is none."""
    window = hf.get("sliding_window") or 0
    if window >= cfg.max_position_embeddings:
        window = 0
    if "layer_types" in hf and hf["layer_types"]:
        types = hf["layer_types"]
    elif every_layer:
        types = ["sliding_attention"] * cfg.num_layers
    else:
        first = hf.get("max_window_layers", cfg.num_layers) if hf.get("use_sliding_window") else cfg.num_layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg.num_layers)]
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _read_qwen2(hf: dict, cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, attention_bias=True, layer_windows=_windows(hf, cfg, every_layer=False))


def _read_qwen3(hf: dict, cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, qk_norm=True, layer_windows=_windows(hf, cfg, every_layer=False))


def _read_mistral(hf: dict, cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, layer_windows=_windows(hf, cfg, every_layer=True))


def _read_phi3(hf: dict, cfg: ModelConfig) -> ModelConfig:
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"Phi-3 with partial_rotary_factor {partial} is not supported (rotary over whole heads is)")
    return replace(cfg, layer_windows=_windows(hf, cfg, every_layer=True))


def _split_rows(name: str, fused: str, parts: tuple[str, ...], rows: list[int]) -> Renamed:
    """A fused tensor stored whole (Phi-3's qkv_proj and gate_up_proj) as its Llama parts, by rows."""
    out, start = [], 0
    for part, n in zip(parts, rows, strict=True):
        out.append((name.replace(fused, part), slice(start, start + n)))
        start += n
    return out


def _rename_phi3(name: str, cfg: ModelConfig) -> Renamed:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if ".qkv_proj." in name:
        return _split_rows(name, ".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj."), [q, kv, kv])
    if ".gate_up_proj." in name:
        return _split_rows(name, ".gate_up_proj.", (".gate_proj.", ".up_proj."), [cfg.intermediate_size] * 2)
    return [(name, None)]


def _read_gemma3(hf: dict, cfg: ModelConfig) -> ModelConfig:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(cap) is not None:
            raise ValueError(f"Gemma 3 with {cap}={hf[cap]} is not supported")
    if "sliding_window_pattern" in hf and not hf.get("layer_types"):  # transformers 4's spelling of layer_types
        pattern = hf["sliding_window_pattern"]
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(cfg.num_layers)]}
    params = hf.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    return replace(cfg, norm_unit_offset=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
                   embedding_scale=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", cfg.head_dim)),
                   layer_windows=_windows(hf, cfg, every_layer=False), local_rope_theta=float(local),
                   tie_word_embeddings=hf.get("tie_word_embeddings", True))


def _read_mixtral(hf: dict, cfg: ModelConfig) -> ModelConfig:
    moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    expert_intermediate_size=hf["intermediate_size"], normalize_top_k=True)
    return replace(cfg, moe=moe, layer_windows=_windows(hf, cfg, every_layer=True))


_MIXTRAL_EXPERT = re.compile(r"(layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rename_mixtral(name: str, cfg: ModelConfig) -> Renamed:
    """block_sparse_moe.gate -> mlp.gate; block_sparse_moe.experts.E.w1 / w3 / w2 -> mlp.experts.E.gate_proj / up_proj /
    down_proj (Mixtral's names for the gate, up and down projections)."""
    m = _MIXTRAL_EXPERT.match(name)
    if not m:
        return [(name, None)]
    part = m.group(2)
    if part != "gate":
        expert, w = part.rsplit(".", 1)
        part = f"{expert}.{_MIXTRAL_PARTS[w]}"
    return [(f"{m.group(1)}.mlp.{part}.{name[m.end():]}", None)]


def _read_qwen2_moe(hf: dict, cfg: ModelConfig) -> ModelConfig:
    step = hf.get("decoder_sparse_step", 1)
    only_mlp = set(hf.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(cfg.num_layers) if i in only_mlp or (i + 1) % step)
    moe = MoEConfig(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    expert_intermediate_size=hf["moe_intermediate_size"],
                    normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0, dense_layers=dense)
    return replace(cfg, attention_bias=bool(hf.get("qkv_bias", True)), moe=moe,
                   layer_windows=_windows(hf, cfg, every_layer=False))


FAMILIES: dict[str, Family] = {family.architecture: family for family in (
    Family("LlamaForCausalLM"),
    Family("Qwen2ForCausalLM", _read_qwen2),
    Family("MistralForCausalLM", _read_mistral),
    Family("Qwen3ForCausalLM", _read_qwen3),
    Family("Phi3ForCausalLM", _read_phi3, _rename_phi3),
    Family("Gemma3ForCausalLM", _read_gemma3),
    Family("MixtralForCausalLM", _read_mixtral, _rename_mixtral),
    Family("Qwen2MoeForCausalLM", _read_qwen2_moe),
)}


def family(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(FAMILIES)}") from None


def _common(hf: dict, arch: str) -> ModelConfig:
    """What every family's config.json gives alike (transformers 4 and 5 spellings of RoPE settings)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer type (Gemma 3): the full layers' are the model's
        params = params["full_attention"] or {}
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta") or params.get("rope_theta", 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=bool(hf.get("attention_bias", False)),
        rope_scaling=scaling,
        architecture=arch,
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """The model description from a config.json dict (or a GGUF's metadata in its keys: loader/gguf.py)."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    return family(arch).read(hf, _common(hf, arch))


def canonical_tensors(tensors: dict, cfg: ModelConfig) -> dict:
    """A checkpoint's tensors (or its grids: tuples of tensors sharing a tensor's rows; or its formats' names) under
    Llama's names, as the decoder takes them. Views, not copies, where a fused tensor splits."""
    rename = family(cfg.architecture).rename
    if rename is None:
        return tensors
    out = {}
    for name, value in tensors.items():
        prefix = "model." if name.startswith("model.") else ""
        for new, rows in rename(name.removeprefix(prefix), cfg):
            part = value
            if rows is not None and not isinstance(value, str):  # a format's name stays as it is
                part = tuple(v[rows] for v in value) if isinstance(value, tuple) else value[rows]
            out[prefix + new] = part
    return out


def config_to_hf(config: ModelConfig) -> dict:
    """A config.json dict for a Llama-shaped model (`config_from_hf`'s inverse, transformers' keys): what
    `llmserve quantize` writes beside the weights it exports."""
    if config.beyond_llama:
        raise ValueError(f"exporting {config.architecture} is not supported: it has {', '.join(config.beyond_llama)}")
    hf = {
        "architectures": [config.architecture],
        "model_type": "qwen2" if config.architecture == "Qwen2ForCausalLM" else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_scaling": config.rope_scaling,
    }
    if config.architecture != "Qwen2ForCausalLM":
        hf["attention_bias"] = config.attention_bias
    return hf
