"""The header-only GGUF reader, and the loader's tensor views built on it, agree with the `gguf` package's
full reader on the real files; a truncated file is refused before any weight is read."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from llmserve.loader.default_models import resolve_model_path
from llmserve.loader.gguf import read_tensors
from llmserve.loader.gguf_header import read_gguf_header
from tests.model_files import gguf_files


@pytest.mark.parametrize("path", gguf_files())
def test_metadata_shapes_and_tensor_bytes_equal_gguf_reader(path) -> None:
    header = read_gguf_header(path)
    reader = GGUFReader(path)
    scalars = {k: f.contents() for k, f in reader.fields.items()
               if f.types and f.types[0] != GGUFValueType.ARRAY and not k.startswith("GGUF.")}
    assert header.metadata.keys() == scalars.keys()
    for key, value in scalars.items():
        assert header.metadata[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert header.tensor_shapes == {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert header.num_params == sum(int(np.prod(t.shape)) for t in reader.tensors)
    ours = read_tensors(path, header)
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    assert len({t.tensor_type for t in ours}) > 1  # more than one format compared (F32 norms and a quantized type)
    for mine, theirs in zip(ours, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8), err_msg=mine.name)


def test_a_truncated_file_is_refused_by_name(tmp_path) -> None:
    path = resolve_model_path(None)[0]
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(path, cut)
    last = read_gguf_header(path).tensors[-1]
    with open(cut, "r+b") as f:
        f.truncate(last.offset + 10)
    with pytest.raises(ValueError, match=f"{last.name}.*truncated"):
        read_tensors(str(cut))


def test_not_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(bad))


@pytest.mark.parametrize("version", [b"\x01\x00\x00\x00", b"\x00\x00\x00\x03"], ids=["v1", "big-endian-v3"])
def test_a_version_it_cannot_read_is_refused(tmp_path, version) -> None:
    old = tmp_path / "x.gguf"
    old.write_bytes(b"GGUF" + version + bytes(64))
    with pytest.raises(ValueError, match="GGUF version .* is not supported"):
        read_gguf_header(str(old))
