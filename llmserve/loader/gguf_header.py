"""A GGUF file's metadata and tensor directory, read from its header alone.

Why not `gguf.GGUFReader`: it parses every array field into numpy views, one per string, so opening a file
costs seconds before any weight is read, the more the larger the vocabulary, on every start of a server
(docs/performance.md, "Start-up"). The loader needs the scalars, and where each tensor's bytes lie; the tokenizer
reads the vocabulary itself (and caches it). Planning (`llmserve plan`) needs only the shape of the model, and no
torch. Here arrays are stepped over, not kept.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
each metadata entry = string key, u32 value type, value; each tensor entry = string name, u32 n_dims,
u64 dims[n_dims] (fastest-varying first), u32 ggml type, u64 data offset (from the data section, which
starts at the next multiple of `general.alignment`, 32 if absent). A string is u64 length + bytes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

# value type -> struct format of a scalar (8 = string and 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes lie: `dims` as the file lists them (fastest-varying first), `offset` from the
    start of the file, `ggml_type` the file's number for its format (`gguf.GGMLQuantizationType`)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """Scalar and string metadata (arrays are skipped), and every tensor's shape (outermost dim first) and
    place in the file."""

    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.dims[::-1] for t in self.tensors}

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.dims) for t in self.tensors)


def read_gguf_header(path: str) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):  # a big-endian file's 3 reads as 50331648 here
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            value, pos = _value(buf, pos, vtype)
            if value is not _SKIPPED:
                metadata[key] = value
        entries = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 4 + 8
            entries.append((name, dims, ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = tuple(TensorInfo(name, tuple(int(d) for d in dims), ggml_type, data_start + offset)
                    for name, dims, ggml_type, offset in entries)
    return GGUFHeader(metadata, tensors)


_SKIPPED = object()
_LENGTH = struct.Struct("<Q")


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8: pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALARS:  # fixed-size elements: jump over them
            return _SKIPPED, pos + count * struct.calcsize(_SCALARS[etype])
        if etype == _STRING:  # a vocabulary: each string's length read, its bytes jumped over (not decoded)
            for _ in range(count):
                pos += 8 + _LENGTH.unpack_from(buf, pos)[0]
            return _SKIPPED, pos
        for _ in range(count):
            _, pos = _value(buf, pos, etype)
        return _SKIPPED, pos
    raise ValueError(f"unknown GGUF value type {vtype} at byte {pos}")
