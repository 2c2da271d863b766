"""A small Qwen2 GGUF made here whose fused linears mix K-quant formats as Qwen2.5-Coder-1.5B's Q4_K_M does (q and
k Q4_K, v Q6_K; gate and up Q4_K, down Q6_K; head Q6_K), for what CI cannot load the 1.5B for; or (`legacy=True`)
whose linears are Q5_0 and Q8_0 alone, as most of Qwen2.5-Coder-0.5B's are, a file the default runs on int8.

Its hidden size is 256 (K-quants need rows of 256 inputs; the 0.5B's 896 are not). The blocks are random but valid:
random 4- and 6-bit levels, scales and factors written in the formats' own bit layouts (ggml's
`dequantize_row_q4_K` / `dequantize_row_q6_K` read them back; gguf-py cannot write K-quants). The tokenizer is the
0.5B's cut to its first 4,074 tokens and their merges, with its 22 special tokens after them (`small_vocabulary`):
its real pre-tokenizer and byte-level BPE, and 4,096 embedding rows instead of 151,936, which transformers parses in
~1.5 s instead of ~30."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
REGULAR_TOKENS = 4074  # + the 0.5B's 22 special tokens: 4,096 rows
SUPER = 256  # inputs per K-quant block
FIXED_MTIME_NS = 1_700_000_000 * 10**9
# Random weights give near ties between a step's two best logits, where float rounding (tensor parallelism's sums,
# another kernel's order) may pick either: with this seed no greedy step of the tests' prompts has its best two
# logits within 0.19 % of each other in either file (the seeds 0-7 range from below 0.01 % to this).
SEED = 6


def q4_k_rows(rows: int, cols: int, rng: np.random.Generator, d: float) -> np.ndarray:
    """[rows, cols / 256 * 144] bytes: per block fp16 d and dmin, 8 (sc, m) of 6 bits in 12 bytes, 128 bytes of
    nibbles (w = d * sc * q - dmin * m per 32 inputs, the low nibbles the first 32 of each 64, the high ones the
    next 32); weights of about 190 x `d` at most."""
    blocks = rows * cols // SUPER
    dmin = np.full(blocks, 8 * d, np.float16)
    d = np.full(blocks, d, np.float16)
    sc = rng.integers(16, 64, (blocks, 8))
    m = np.round(sc * 7.5 / 8).astype(np.int64)  # about half the group's range: centred weights
    sc[:, 0] = m[:, 0] = 63  # as llama.cpp writes them: each block's largest 63
    packed = np.zeros((blocks, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    qs = rng.integers(0, 256, (blocks, 128), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(blocks, 2), dmin.view(np.uint8).reshape(blocks, 2), packed, qs],
                          axis=1).reshape(rows, -1)


def q6_k_rows(rows: int, cols: int, rng: np.random.Generator, d: float) -> np.ndarray:
    """[rows, cols / 256 * 210] bytes: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 sc, fp16 d
    (w = d * sc * (q - 32) per 16 inputs; any bytes are valid levels): weights of about 1300 x `d` at most."""
    blocks = rows * cols // SUPER
    bits = rng.integers(0, 256, (blocks, 192), dtype=np.uint8)
    sc = rng.integers(8, 41, (blocks, 16)).astype(np.int8) * rng.choice(np.array([-1, 1], np.int8), (blocks, 16))
    d = np.full(blocks, d, np.float16)
    return np.concatenate([bits, sc.view(np.uint8), d.view(np.uint8).reshape(blocks, 2)], axis=1).reshape(rows, -1)


def legacy_rows(kind: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, d: float) -> np.ndarray:
    """Q5_0 or Q8_0 bytes of Gaussian weights, gguf-py's own quantizer: weights of about 190 x `d` at most, as
    `q4_k_rows`'."""
    return quants.quantize((rng.standard_normal((rows, cols)) * 50 * d).astype(np.float32), kind)


@functools.cache
def _tokenizer_of(path: str) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """A GGUF's tokenizer fields (key, contents, type, element type) cut to `small_vocabulary`, read once a process:
    the reader takes ~10 s over a 151k-token vocabulary."""
    source = GGUFReader(path)
    fields = {key: (field.contents(), field.types[0], field.types[-1] if field.types[0] == GGUFValueType.ARRAY
                    else None) for key, field in source.fields.items() if key.startswith("tokenizer.")}
    return small_vocabulary(fields, REGULAR_TOKENS)


def small_vocabulary(fields: dict[str, tuple[object, GGUFValueType, GGUFValueType | None]],
                     regular: int) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """A byte-level BPE vocabulary cut to its first `regular` tokens, the merges that make them (a merge's rank is
    its token's id less 256 in Qwen's file, so these are its first merges) and its control and user-defined tokens
    renumbered to follow them: every text still encodes, into the pieces the full vocabulary's first merges make."""
    tokens, types = fields["tokenizer.ggml.tokens"][0], fields["tokenizer.ggml.token_type"][0]
    special = [i for i in range(regular, len(tokens)) if types[i] in (3, 4)]  # control, user-defined
    kept = list(range(regular)) + special
    new_id = {old: new for new, old in enumerate(kept)}
    pieces = {tokens[i] for i in range(regular)}
    merges = [m for m in fields["tokenizer.ggml.merges"][0] if m.replace(" ", "", 1) in pieces]
    cut = {"tokenizer.ggml.tokens": [tokens[i] for i in kept], "tokenizer.ggml.token_type": [types[i] for i in kept],
           "tokenizer.ggml.merges": merges}
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.bos_token_id"):
        if key in fields:
            cut[key] = new_id[fields[key][0]]
    return [(key, cut.get(key, contents), kind, sub_kind) for key, (contents, kind, sub_kind) in fields.items()]


def write_mixed_gguf(path: Path, vocabulary_from: str, seed: int = SEED, legacy: bool = False) -> Path:
    """The model at `path`, its tokenizer the GGUF `vocabulary_from`'s (a Qwen2 one) cut small. `legacy`: the
    4-bit tensors Q5_0 and the 6-bit ones Q8_0 (the embedding stays Q4_K)."""
    rng = np.random.default_rng(seed)
    tokenizer_fields = _tokenizer_of(vocabulary_from)
    vocab = len(next(contents for key, contents, *_ in tokenizer_fields if key == "tokenizer.ggml.tokens"))
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_name("Q5_0 and Q8_0 test model" if legacy else "mixed K-quant test model")
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, contents, kind, sub_kind in tokenizer_fields:
        writer.add_key_value(key, contents, kind, sub_kind)
    q4, q6 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
    if legacy:
        q4, q6 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
    # the embedding and head spread (clear greedy choices), the layers' weights small (a random network's
    # attention and residual stream stay calm: no near tie turns on float rounding)
    tensors = {"token_embd.weight": (GGMLQuantizationType.Q4_K, vocab, HIDDEN, 1e-3),
               "output.weight": (q6, vocab, HIDDEN, 5e-4)}
    for i in range(LAYERS):
        tensors |= {f"blk.{i}.attn_q.weight": (q4, HIDDEN, HIDDEN, 1e-4),
                    f"blk.{i}.attn_k.weight": (q4, KV_HEADS * HEAD_DIM, HIDDEN, 1e-4),
                    f"blk.{i}.attn_v.weight": (q6, KV_HEADS * HEAD_DIM, HIDDEN, 5e-5),
                    f"blk.{i}.attn_output.weight": (q4, HIDDEN, HIDDEN, 1e-4),
                    f"blk.{i}.ffn_gate.weight": (q4, INTERMEDIATE, HIDDEN, 1e-4),
                    f"blk.{i}.ffn_up.weight": (q4, INTERMEDIATE, HIDDEN, 1e-4),
                    f"blk.{i}.ffn_down.weight": (q6, HIDDEN, INTERMEDIATE, 5e-5)}
    for name, (kind, rows, cols, d) in tensors.items():
        if kind in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0):
            data = legacy_rows(kind, rows, cols, rng, d)
        else:
            data = (q4_k_rows if kind == GGMLQuantizationType.Q4_K else q6_k_rows)(rows, cols, rng, d)
        writer.add_tensor(name, data, raw_dtype=kind)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for part, rows in (("q", HIDDEN), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
            writer.add_tensor(f"blk.{i}.attn_{part}.bias", (0.5 * rng.standard_normal(rows)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the same bytes every time, so the same modification time: the tokenizer converted from its fields is cached
    # by file name, size and mtime (`gguf_tokenizer`), once, not once per run
    os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    return path
