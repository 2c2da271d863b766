"""transformers' reading of a GGUF file, kept: the next reading maps it and computes the same logits."""

from __future__ import annotations

import pytest
import torch

from llmserve.evaluate import reference
from llmserve.evaluate.reference import reference_model


@pytest.fixture
def kept_readings(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(reference, "MIN_READ_SECONDS", 0.0)  # a small model's reading is quicker than worth keeping
    return tmp_path / "reference"


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([[1, 50, 345, 28, 464, 31]])).logits[0]


def test_a_second_reading_maps_the_kept_model_and_an_unreadable_one_is_read_again(kept_readings, mixed_kquant_gguf):
    read = reference_model(mixed_kquant_gguf, torch.float32)  # a small Qwen2 GGUF: a reading takes a second
    [kept] = kept_readings.glob("*.pt")
    size = kept.stat().st_size
    mapped = reference_model(mixed_kquant_gguf, torch.float32)
    assert type(mapped) is type(read)
    assert torch.equal(_logits(mapped), _logits(read))
    assert all(_mapped_from(kept, t) for t in mapped.parameters())  # not read from the GGUF again

    kept.write_bytes(b"truncated")
    read_again = reference_model(mixed_kquant_gguf, torch.float32)
    assert torch.equal(_logits(read_again), _logits(read))
    assert kept.stat().st_size == size  # replaced


def _mapped_from(path, tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory lies in a mapping of `path` (/proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= address < high:
                    return True
    return False
