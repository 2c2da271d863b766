"""Tiny randomly initialised Hugging Face directories for quantization tests (made here, no download).

The default model's tokenizer is reused, so the vocabulary matches it. Each RMSNorm weight has a few
channels eight times larger than the rest: the activation outliers real models have, which are what
AWQ's scales are for (without them its search has nothing to find)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen2Config

from llmserve.loader import load_tokenizer


def make_tiny_hf_dir(path: Path, kind: str = "qwen2", kv_heads: int = 2, hidden: int = 128,
                     intermediate: int = 256, layers: int = 2, seed: int = 0, tokenizer=None) -> Path:
    """A checkpoint of 4 heads: Qwen2 (q/k/v biases, separate output head), Llama (tied head), Gemma 3 (norms
    scaling by 1 + w, sandwich and query/key norms, a sliding layer before a full one) or Mixtral (4 experts, 2 a
    token); `tokenizer` (default: the default model's) sets its vocabulary, rounded up to a multiple of 64 as real
    models pad it."""
    torch.manual_seed(seed)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
    vocab = -(-len(tokenizer) // 64) * 64
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    config = {
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=False),
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=True),
        "gemma3": lambda: Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                                           layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                           pad_token_id=0),
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:  # Gemma's store w, scaling by 1 + w
                p.copy_(1 + 0.1 * torch.randn_like(p))
                p[:4] *= 8
                p -= int(kind == "gemma3")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def trained_tokenizer(corpus: list[str], vocab_size: int = 500):
    """A byte-level BPE tokenizer trained here on `corpus` (bos 1, eos 2, as the tiny models say): for a
    machine that has none of the shipped models' files, a GPU machine's, say."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
