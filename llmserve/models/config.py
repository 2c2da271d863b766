"""The model, declared once as data: what every family's decoder is made of.

One description serves every path that runs a model (the eager forward, the one-call native decode stack,
calibration, tensor parallelism, the planner): each reads the fields it needs, and a path that cannot run a
field's value says so (AWQ's experts, the build plan) instead of computing something else. A family
(`models/families.py`) is how one Hugging Face architecture's config and tensor names map onto this description;
the fields' defaults are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts block in place of the MLP: a router picks `top_k` of `num_experts` gated MLPs
    per token and sums their outputs by its softmax weights (Mixtral, Qwen2-MoE)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool  # the top-k weights renormalized to sum to 1 (Mixtral: always; Qwen2-MoE: norm_topk_prob)
    # Qwen2-MoE: a dense expert every token passes through, scaled by sigmoid(its own one-row gate); 0: none
    shared_expert_intermediate_size: int = 0
    # layers whose MLP stays dense (Qwen2-MoE's mlp_only_layers and decoder_sparse_step); they use intermediate_size
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    rope_scaling: dict | None = None
    architecture: str = "LlamaForCausalLM"
    # Gemma: RMSNorm scales by (1 + w), computed in float32 and rounded once (Llama rounds, then scales by w)
    norm_unit_offset: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    # Gemma 3: each block's output normed before the residual add (post_attention_layernorm of the attention's,
    # post_feedforward_layernorm of the MLP's), and the MLP's input by pre_feedforward_layernorm
    sandwich_norms: bool = False
    activation: str = "silu"  # the gated MLP's: "silu" | "gelu_tanh" (Gemma)
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size), in the model dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: 1/sqrt(head_dim) (Gemma 3)
    # each layer's sliding attention window in tokens (0: full attention); empty: every layer full
    layer_windows: tuple[int, ...] = ()
    # the rotary base of windowed layers, which take no rope scaling (Gemma 3's local layers); None: rope_theta
    local_rope_theta: float | None = None
    moe: MoEConfig | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` holds a mixture of experts (else a dense gated MLP)."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the local rotary table (windowed, with a base of its own)."""
        return self.local_rope_theta is not None and self.window(layer) > 0

    @property
    def beyond_llama(self) -> list[str]:
        """What this model has beyond a Llama/Qwen2 decoder (empty where it has nothing): for paths that run only
        that shape to name in their refusal."""
        extras = {"norms that scale by 1 + w": self.norm_unit_offset, "query/key norms": self.qk_norm,
                  "sandwich norms": self.sandwich_norms, f"a {self.activation} gate": self.activation != "silu",
                  "scaled embeddings": self.embedding_scale,
                  "an attention scale of its own": self.query_pre_attn_scalar is not None,
                  "sliding-window attention": any(self.layer_windows),
                  "a local rotary base": self.local_rope_theta is not None, "experts": self.moe is not None}
        return [what for what, present in extras.items() if present]
