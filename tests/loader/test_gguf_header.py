"""The header-only GGUF reader agrees with the `gguf` package's full reader on the default model's file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from llmserve.loader.default_models import resolve_model_path
from llmserve.loader.gguf_header import read_gguf_header


def test_metadata_and_shapes_equal_gguf_reader() -> None:
    path = resolve_model_path(None)[0]
    header = read_gguf_header(path)
    reader = GGUFReader(path)
    scalars = {k: f.contents() for k, f in reader.fields.items()
               if f.types and f.types[0] != GGUFValueType.ARRAY and not k.startswith("GGUF.")}
    assert header.metadata.keys() == scalars.keys()
    for key, value in scalars.items():
        assert header.metadata[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert header.tensor_shapes == {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert header.num_params == sum(int(np.prod(t.shape)) for t in reader.tensors)


def test_not_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(bad))
