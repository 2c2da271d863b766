"""The block decoders, torch's and the native one (`kernels/ggml_decode.cpp`), give the `gguf` package's values bit
for bit: on random blocks of every format they decode (every bit pattern of the packed levels and scales), and on
the tensors of the real files."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from llmserve.kernels import load_cpu_kernels
from llmserve.loader.ggml_blocks import dequantize
from llmserve.loader.gguf import read_tensors
from tests.model_files import gguf_files

Q = GGMLQuantizationType
# the byte offsets of each format's float16 fields (kept finite in the random blocks: a NaN has no one value)
_FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
                Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}  # Q2_K: not ours, the package's decoder


DECODERS = pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _same_bits(ours, theirs: np.ndarray) -> bool:
    ours = ours.numpy()
    return ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@DECODERS
@pytest.mark.parametrize("qtype", list(_FP16_FIELDS), ids=lambda q: q.name)
def test_random_blocks_decode_as_the_gguf_package_does(qtype, native) -> None:
    rng = np.random.default_rng(int(qtype))
    _, type_size = GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, size=(48, 3 * type_size), dtype=np.uint8)
    blocks = rows.reshape(-1, type_size)
    for at in _FP16_FIELDS[qtype]:
        values = rng.normal(scale=rng.choice([1e-4, 1.0, 300.0]), size=(len(blocks), 1))
        blocks[:, at:at + 2] = values.astype(np.float16).view(np.uint8)
    theirs = gguf_dequantize(rows, qtype)
    assert _same_bits(dequantize(rows, qtype, native), theirs.reshape(len(rows), -1))
    rows.flags.writeable = False  # as the loader hands them: views of a read-only map of the file
    assert _same_bits(dequantize(rows, qtype, native), theirs.reshape(len(rows), -1))


@DECODERS
@pytest.mark.parametrize("path", gguf_files())
def test_a_real_file_s_tensors_decode_as_the_gguf_package_does(path, native) -> None:
    """Each quantized format of the file, its first and its last tensor (the random blocks cover the rest)."""
    by_format: dict[Q, list] = {}
    for tensor in read_tensors(path):
        if tensor.tensor_type not in (Q.F32, Q.F16):
            by_format.setdefault(tensor.tensor_type, []).append(tensor)
    assert by_format
    for tensors in by_format.values():
        for tensor in {id(t): t for t in (tensors[0], tensors[-1])}.values():
            theirs = gguf_dequantize(tensor.data, tensor.tensor_type)
            ours = dequantize(tensor.data, tensor.tensor_type, native)
            assert _same_bits(ours, theirs.reshape(len(tensor.data), -1)), \
                tensor.name
