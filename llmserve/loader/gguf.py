"""GGUF files (llama.cpp's format): config from metadata, tensors dequantized by `ggml_blocks`,
tokenizer and chat template from the file itself. The header is read by `gguf_header` (not `gguf.GGUFReader`,
which spends seconds on the vocabulary arrays); the tensors are views of one read-only map of the file.

The metadata becomes the config.json dict transformers writes for the architecture, and the tensors take
transformers' names and values, so a GGUF and a Hugging Face directory reach the engine one way. llama.cpp's
converter changes two things we undo: it permutes the rows of Llama q/k weights for its interleaved RoPE (so
one rotate-half RoPE serves both), and it stores Gemma's norm weights plus one (Gemma's RMSNorm multiplies by
1 + w; llama.cpp's by w).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, quant_shape_to_byte_shape

from llmserve.loader.checkpoint import Checkpoint, LazyGrids, LazyTensors
from llmserve.loader.download import cache_root
from llmserve.loader.ggml_blocks import dequantize
from llmserve.loader.gguf_header import GGUFHeader, read_gguf_header
from llmserve.models.families import config_from_hf

logger = logging.getLogger(__name__)

# general.architecture -> (transformers' architecture, its model_type); Gemma 3's text-only model is gemma3_text
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms both sides of the attention and of the MLP: llama.cpp's ffn_norm is its pre-MLP norm, as for
# Llama, but there transformers' post_attention_layernorm is the norm of the attention's output
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSORS_OF = {"gemma3": _GEMMA3_LAYER_TENSORS}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# the architectures whose norm weights llama.cpp stores plus one
_NORM_PLUS_ONE = frozenset({"gemma3"})


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. `shape` as the file lists it (fastest-varying first); `data` a read-only view
    of its bytes: float32 or float16 values, or for every other format uint8 rows of its blocks (what
    `gguf.quants.dequantize` takes; the views `gguf.GGUFReader` gives)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    # hands its bytes' pages back to the file (the map stays; a later read faults them in again from the page cache):
    # a decoded tensor's need not stay resident while the rest of the model loads
    release: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)


def read_tensors(path: str, header: GGUFHeader | None = None) -> list[GGUFTensor]:
    """Every tensor of the file, as views of one read-only map: nothing is read until used."""
    header = header or read_gguf_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    file = mapped.view(np.ndarray)  # views of a memmap are memmaps: slower ops
    release = _page_releaser(mapped._mmap)
    tensors = []
    for info in header.tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        end = info.offset + math.prod(info.dims) // block * type_size
        if end > len(file):
            raise ValueError(f"{path}: tensor {info.name!r} ends at byte {end}, past the end of the file "
                             f"({len(file)} bytes): the file is truncated")
        raw, shape = file[info.offset:end], info.dims[::-1]
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(info.name, qtype, info.dims, data,
                                  lambda start=info.offset, stop=end: release(start, stop)))
    return tensors


def _page_releaser(mm: mmap.mmap | None) -> Callable[[int, int], None]:
    """release(start, end): the whole pages of the file's bytes [start, end) dropped from this process's memory
    (MADV_DONTNEED; clean file pages, so nothing is lost). Where the map cannot be advised, nothing."""
    page = mmap.PAGESIZE

    def release(start: int, end: int) -> None:
        first, last = -(-start // page) * page, end // page * page
        if mm is not None and last > first and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED, first, last - first)

    return release


def load_gguf(path: str, name: str, tokenizer: object | None = None) -> Checkpoint:
    """`tokenizer`: one already read from this file's tokenizer (see `load_checkpoint`)."""
    header = read_gguf_header(path)  # the vocabulary arrays are skipped: the tokenizer reads them itself
    meta = header.metadata
    arch = meta["general.architecture"]
    hf = hf_config_from_metadata(meta, arch, header.tensor_shapes)
    config = config_from_hf(hf)
    makers, formats, named = {}, {}, []
    for tensor in read_tensors(path, header):
        hf_name = _hf_name(tensor.name, arch)
        heads = None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf["num_attention_heads"] if "q_proj" in hf_name else hf["num_key_value_heads"]
        makers[hf_name] = _decoder(tensor, heads, arch in _NORM_PLUS_ONE and hf_name.endswith("norm.weight"))
        formats[hf_name] = tensor.tensor_type.name
        named.append((hf_name, tensor, heads))
    weights = LazyTensors(makers)
    int4_grids, int8_grids = _lazy_grids(named)
    if tokenizer is None:
        tokenizer = gguf_tokenizer(path)
    return Checkpoint(
        name=name,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=gguf_eos_ids(meta),
        source_formats=formats,
        int4_grids=int4_grids,
        int8_grids=int8_grids,
    )


def _lazy_grids(named: list[tuple[str, GGUFTensor, int | None]]) -> tuple[LazyGrids, LazyGrids]:
    """The file's int4 and int8 grids (`Checkpoint.int4_grids`, `int8_grids`) by Hugging Face name, both read
    when either is first used; `named`: (name, tensor, heads to unpermute or None) per tensor."""
    read: list[list[dict]] = []

    def part(which: int) -> dict:
        if not read:
            grids, grids8 = {}, {}
            for hf_name, tensor, heads in named:
                grid, grid8 = int4_grid(tensor), int8_grid(tensor)
                if heads is not None:
                    grid = grid and tuple(_unpermute_rope_rows(g, heads) for g in grid)
                    grid8 = grid8 and tuple(_unpermute_rope_rows(g, heads) for g in grid8)
                tensor.release()  # the grids read every block's header: all its pages, until it is decoded
                for found, into in ((grid, grids), (grid8, grids8)):
                    if found is not None:
                        into[hf_name] = tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in found)
            read.append([grids, grids8])
        found, read[0][which] = read[0][which], {}  # held by its LazyGrids alone: dropped with it
        return found

    return LazyGrids(lambda: part(0)), LazyGrids(lambda: part(1))


def gguf_eos_ids(meta: dict) -> list[int]:
    """The ids that end a sequence: the file's EOS, and its end-of-turn token where it lists one (a chat model's
    turn ends there, not at EOS)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def hf_config_from_metadata(meta: dict, arch: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The config.json dict transformers writes for this model, from llama.cpp's metadata keys and the tensor
    shapes: the one description the engine builds its config from, for a GGUF as for a Hugging Face directory."""
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
    if "rope_freqs.weight" in shapes:
        raise ValueError("GGUF files with rope_freqs (Llama-3.1 scaling) are not supported; use the HF directory")
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    layers = int(meta[f"{arch}.block_count"])
    # key_length is llama.cpp's head size; Gemma's (256) is not hidden / heads, and it has no rope dimension
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    architecture, model_type = _ARCHITECTURES[arch]
    hf = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta[f"{arch}.context_length"]),
        "tie_word_embeddings": "output.weight" not in shapes,
        "rope_scaling": scaling,
    }
    if arch == "gemma3":
        hf.update(_gemma3_config(meta, hidden, heads, layers, head_dim))
    else:  # Qwen2's q/k/v biases come with its architecture (its config.json has no attention_bias)
        hf["hidden_act"] = "silu"
        if arch == "llama":
            hf["attention_bias"] = False
    return hf


def _gemma3_config(meta: dict, hidden: int, heads: int, layers: int, head_dim: int) -> dict:
    """What Gemma 3's config.json adds. The file stores only the window's size; the rest is what llama.cpp
    decides for gemma3 (as transformers' defaults do): every sixth layer attends to the whole context, the others
    to `sliding_window` tokens with RoPE base 10,000 (the global layers' is the file's freq_base, and only they
    take its linear scaling); queries are scaled by 1 / sqrt(head_dim), except in the 27B model (62 layers) by
    1 / sqrt(hidden / heads). A file without a window attends to the whole context in every layer."""
    window = int(meta.get("gemma3.attention.sliding_window") or 0)
    pattern = 6 if window else 1
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": _optional_float(meta.get("gemma3.final_logit_softcapping")),
        "attn_logit_softcapping": _optional_float(meta.get("gemma3.attn_logit_softcapping")),
    }


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)


def _hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    names = _LAYER_TENSORS_OF.get(arch, _LAYER_TENSORS)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _decoder(tensor: GGUFTensor, heads: int | None, plus_one: bool) -> Callable[[], torch.Tensor]:
    """What makes the tensor's transformers values when the model takes it: decoded, its rows un-permuted for
    `heads` (Llama's q/k), less one (`plus_one`: Gemma's norms, in float32 as transformers' GGUF loader does)."""

    def make() -> torch.Tensor:
        array = _dense(tensor)
        tensor.release()
        if heads is not None:
            array = _unpermute_rope_rows(array, heads)
        if plus_one:
            array = array - 1
        return array.contiguous()

    return make


def _dense(tensor: GGUFTensor) -> torch.Tensor:
    """float32 values in PyTorch's [out, in] order (GGUF lists shapes innermost first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(shape)  # a copy: the map is read-only
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


# the 4-bit GGML types (a block's bytes and inputs: `GGML_QUANT_SIZES`)
_INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K})
# their names, as `Checkpoint.source_formats` gives them: the formats that come with an int4 grid
INT4_GRID_FORMATS = frozenset(t.name for t in _INT4_TYPES)


def int4_grid(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, min) per group of 32 inputs, float32 [out, in / 32], for a tensor stored on a 4-bit grid
    (w = q * scale + min, q in [0, 15]); None for any other type. Q4_0: w = d (q - 8); Q4_1: w = d q + m;
    Q4_K: eight groups of 32 per block of 256, w = (d sc) q - (dmin m), sc and m 6-bit."""
    if tensor.tensor_type not in _INT4_TYPES:
        return None
    per_block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    out_features = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    if tensor.tensor_type == GGMLQuantizationType.Q4_0:
        scale, low = d, -8 * d
    elif tensor.tensor_type == GGMLQuantizationType.Q4_1:
        scale, low = d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    else:
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale, low = d * sc.astype(np.float32), -dmin * m.astype(np.float32)
    groups = len(blocks) * per_block // 32 // out_features
    return scale.reshape(out_features, groups), low.reshape(out_features, groups)


# the types whose values are an fp16 d (a block's first bytes) per 32 inputs times an integer that int8 holds
_D32_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0})


def int8_grid(tensor: GGUFTensor) -> tuple[np.ndarray, ...] | None:
    """The grid int8 keeps a tensor's values on: (d [out, in / 256] float32, sc [out, in / 16] int8) for Q6_K
    (w = d * sc * (q - 32), q in [0, 63]); (d [out, in / 32] float32,) for Q8_0 (w = d * q, q in [-127, 127]) and
    Q5_0 (w = d * (q - 16), q in [0, 31]); None for any other type."""
    out_features = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    if tensor.tensor_type in _D32_TYPES:
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[tensor.tensor_type][1])
        return (blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(out_features, -1),)
    if tensor.tensor_type != GGMLQuantizationType.Q6_K:
        return None
    # per 256 inputs: 128 bytes of low nibbles, 64 of top bits, 16 int8 sc, an fp16 d
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q6_K][1])
    sc = blocks[:, 192:208].copy().view(np.int8)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return d.reshape(out_features, -1), sc.reshape(out_features, -1)


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` (rows: interleaved pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_cache_folder(path: str) -> str:
    """Where a GGUF file's converted tokenizer is kept: one folder per file name, size and modification time."""
    stat = os.stat(path)
    return os.path.join(cache_root(), "tokenizers", f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}")


def gguf_tokenizer(path: str):
    """The GGUF vocabulary as a fast HF tokenizer; converted once, then read from a cache folder."""
    from transformers import AutoTokenizer

    folder, filename = os.path.split(os.path.abspath(path))
    cached = tokenizer_cache_folder(path)
    if os.path.exists(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    logger.info("building the tokenizer from the GGUF metadata (once; cached in %s)", cached)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only home only costs the conversion next time
        logger.warning("could not cache the tokenizer: %s", e)
    return tokenizer
