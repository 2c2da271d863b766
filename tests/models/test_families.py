"""Every registered family on a tiny randomly initialised checkpoint saved as a Hugging Face directory (made here,
no download): our greedy output equals transformers' — dense families (Qwen2's q/k/v bias, Llama 3's RoPE scaling,
Mistral's and Phi-3's sliding windows, Qwen3's query/key norms, Gemma 3's norms, local/global layers and scaled
embeddings) and mixtures of experts (Mixtral; Qwen2-MoE with its shared expert and a dense layer) — in one batch,
alone, with prompts split into chunks and with prefix-cache hits, every KV block back at the end."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.evaluate.reference import reference_greedy
from llmserve.kernels import native_quantized_kernels
from llmserve.kv_cache.key_smoothing import cannot_smooth
from llmserve.loader import build_model, load_checkpoint
from tests.greedy import assert_fused_equals_layer_by_layer, assert_greedy_equals

VOCAB = 49152  # the default model's tokenizer is reused, so the vocabulary matches it
WINDOW = 24  # shorter than most prompts below, so windowed layers drop keys


def _tiny_configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    return {
        "qwen2": transformers.Qwen2Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=False),
        "llama3-scaled": transformers.LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500_000.0,
        ),
        "mistral": transformers.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False),
        "phi3": transformers.Phi3Config(**common, sliding_window=WINDOW, pad_token_id=0, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "gemma3": transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, pad_token_id=0),
        "mixtral": transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                              tie_word_embeddings=False),
        "qwen2-moe": transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False),
    }


FAMILIES = list(_tiny_configs())


def _tiny_checkpoint(kind: str, path, tokenizer) -> torch.nn.Module:
    """transformers' model of this family with larger weights than its init (so tokens vary), biases and norms
    off their defaults, saved with the default model's tokenizer; returned as the reference."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_tiny_configs()[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
            else:  # norms: Gemma's scale by 1 + w, so a w of 0 would hide a missing offset
                p.add_(torch.randn_like(p) * 0.3)
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, llm_fp32, prompt_token_ids):
    """Each family's (directory, reference model, its greedy tokens for the prompts), made once."""
    # the shortest (a window is reached only while decoding) and three longer than a window and a few blocks
    by_length = sorted((ids for ids in prompt_token_ids if len(ids) < 400), key=len)
    prompts = [by_length[0], *by_length[-3:]]
    made = {}

    def get(kind: str):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            reference = _tiny_checkpoint(kind, path, llm_fp32.get_tokenizer())
            made[kind] = (str(path), reference, [reference_greedy(reference, ids, 24) for ids in prompts])
        return made[kind]

    get.prompts = prompts
    return get


@pytest.mark.parametrize("kind", FAMILIES)
def test_tiny_checkpoint_matches_transformers(kind, checkpoints):
    path, reference, expected = checkpoints(kind)
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.05)
    assert len({tuple(e) for e in expected}) > 1  # the check is not vacuous
    assert_greedy_equals(llm, checkpoints.prompts, expected)
    cfg = llm.engine.model_config
    assert cfg.architecture == type(reference).__name__
    if kind in ("mistral", "phi3", "gemma3"):  # the windows are shorter than the prompts: they are exercised
        assert any(cfg.layer_windows) and max(map(len, checkpoints.prompts)) > 2 * WINDOW
    assert (cfg.moe is not None) == (kind in ("mixtral", "qwen2-moe"))


@pytest.mark.parametrize("kind", FAMILIES)
@torch.no_grad()
def test_the_calibration_forward_equals_transformers(kind, checkpoints):
    """Calibrations (AWQ, key smoothing) run the serving forward over one whole sequence without a KV cache: its
    logits are transformers' on every family, over a prompt longer than the windows."""
    path, reference, _ = checkpoints(kind)
    model = build_model(load_checkpoint(path), torch.float32, "cpu")
    ids = torch.tensor(checkpoints.prompts[-1])
    expected = reference(ids[None]).logits[0]
    torch.testing.assert_close(model.compute_logits(model.forward_sequence(ids)), expected, rtol=1e-4,
                               atol=1e-4 * max(1.0, expected.abs().max()))


def test_query_key_norms_leave_an_int8_cache_unsmoothed(checkpoints):
    """Key smoothing scales k_proj's rows; Qwen3's key norm would undo that per head, so it is not applied (and
    the model still equals transformers through an int8 cache's first token)."""
    path, reference, expected = checkpoints("qwen3")
    llm = LLM(path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_gb=0.05)
    assert cannot_smooth(llm.engine.runner.model) and llm.engine.runner.key_smoothing is None
    first = llm.generate(checkpoints.prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert [out.outputs[0].token_ids[0] for out in first] == [e[0] for e in expected]


def test_chunked_prefill_and_prefix_cache_hits_match_transformers(checkpoints):
    """Prompts in chunks of 16 tokens (each chunk attends to the cached ones before it, through the window where
    there is one), then the same prompts again, their full blocks taken from the prefix cache. Gemma 3's local and
    global layers take each chunk both ways in the same step; every other family's layers are windowed or full
    alike (the attention backends see only each layer's window), and an MLP or expert sees a chunk's rows
    as any other rows."""
    path, _, expected = checkpoints("gemma3")
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.05, max_num_batched_tokens=16,
              long_prefill_token_threshold=16, enable_prefix_caching=True)
    assert 0 in llm.engine.model_config.layer_windows and any(llm.engine.model_config.layer_windows)
    assert_greedy_equals(llm, checkpoints.prompts, expected)
    hits = llm.engine.kv_cache.stats.hits
    assert_greedy_equals(llm, checkpoints.prompts, expected)
    assert llm.engine.kv_cache.stats.hits > hits


@pytest.mark.skipif(not native_quantized_kernels(), reason="the one native call needs the native int4 kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_one_native_call_computes_what_the_layers_do(kind, dtype, checkpoints):
    """Decode steps as one native call (kernels/decode_layer.cpp), built from each family's description (Gemma 3's
    unit-offset, query/key and sandwich norms, tanh-GELU gate, scaled embeddings, local rotary table and windows;
    Qwen3's query/key norms; Mistral's and Phi-3's windows; Qwen2's biases; Llama 3's scaled rotary table; Mixtral's
    experts, Qwen2-MoE's shared expert and dense layer), give the layer-by-layer forward's tokens and
    log-probabilities to the last bit, past the windows."""
    path, _, _ = checkpoints(kind)
    # (prefix caching off: the second run would prefill after cached blocks, which rounds otherwise than a whole
    # prompt does)
    llm = LLM(path, dtype=dtype, quantization="int4", kernels="native", kv_cache_memory_gb=0.05,
              enable_prefix_caching=False)
    assert llm.engine.runner.fused_stack is not None and llm.engine.plan.fused_decode_max_tokens > 0
    assert_fused_equals_layer_by_layer(llm, checkpoints.prompts, SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, logprobs=3))


def test_qwen2_biases_are_not_vacuous(checkpoints):
    """Without its q/k/v biases the Qwen2 reference's tokens differ, so a model that dropped them would fail. On a
    copy: the module's reference stays as saved. The first prompt whose tokens differ settles it."""
    _, reference, expected = checkpoints("qwen2")
    unbiased = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in unbiased.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    assert any(reference_greedy(unbiased, ids, 24) != tokens
               for ids, tokens in zip(checkpoints.prompts, expected, strict=True))


def _int4_moe_reference(reference: torch.nn.Module) -> torch.nn.Module:
    """transformers' Mixtral with every weight llmserve's int4 quantizes at the values it computes with: the attention
    linears and output head as `quantized_reference` makes them, each expert's gate/up and down (transformers holds
    them as one 3D tensor per layer) through the same `WeightOnlyLinear`. The router stays dense in both."""
    from llmserve.evaluate.reference import quantized_reference
    from llmserve.quantization.weight_only import WeightOnlyLinear

    ref = quantized_reference(reference, "int4")
    with torch.no_grad():
        for layer in ref.model.layers:
            experts = layer.mlp.experts
            for weights in (experts.gate_up_proj, experts.down_proj):
                for e in range(weights.shape[0]):
                    weights[e].copy_(WeightOnlyLinear(weights[e].clone(), "int4").weight)
    return ref


def _router_margin(reference: torch.nn.Module, ids: list[int]) -> float:
    """The smallest gap, over every layer and position of `ids`, between the k-th and the (k+1)-th expert's router
    logit: where it is tiny, an input rounded in its last bits (the int4 kernel's ~16-bit activations) may pick the
    other expert, which moves the output by a whole expert's share, not by a rounding."""
    gaps = []

    def record(module, args, out):
        logits = (out[0] if isinstance(out, tuple) else out).float().sort(-1, descending=True).values
        gaps.append(float((logits[:, module.top_k - 1] - logits[:, module.top_k]).min()))

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in reference.model.layers]
    try:
        with torch.no_grad():
            reference(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return min(gaps)


def test_experts_run_on_the_native_int4_kernels_and_equal_transformers_on_the_same_weights(checkpoints):
    """Equal wherever the routing is decided by more than rounding: prompts whose router has a near tie (a margin
    under 1e-3 between the last expert picked and the next) may part from the reference, and are left out."""
    path, reference, _ = checkpoints("mixtral")
    ref = _int4_moe_reference(reference)
    expected = [reference_greedy(ref, ids, 16) for ids in checkpoints.prompts]
    clear = [i for i, ids in enumerate(checkpoints.prompts) if _router_margin(ref, ids + expected[i]) > 1e-3]
    assert len(clear) >= 2
    llm = LLM(path, dtype="float32", quantization="int4", kv_cache_memory_gb=0.05)
    experts = [lin for layer in llm.engine.runner.model.layers for expert in layer.mlp.experts
               for lin in (expert.gate_up_proj, expert.down_proj)]
    assert len(experts) == 3 * 4 * 2 and all(lin.method == "int4" for lin in experts)
    if llm.engine.plan.small_step_kernels == "native":
        assert all(lin.native for lin in experts)
    assert_greedy_equals(llm, [checkpoints.prompts[i] for i in clear], [expected[i] for i in clear])


@pytest.mark.processes
def test_experts_split_over_two_ranks_give_the_one_rank_tokens(checkpoints):
    """Tensor parallel: each expert (and the shared one) split by its hidden units like a dense MLP, the router
    replicated; Qwen2-MoE's dense layer split as usual."""
    path, _, expected = checkpoints("qwen2-moe")
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory_gb=0.05, tensor_parallel_size=2)
    try:
        outs = llm.generate(checkpoints.prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
