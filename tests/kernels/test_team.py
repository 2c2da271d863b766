"""kernels/team.h, the decode stack's threads held as one team: every index of a piece runs once, in the chunks
`at::parallel_for` gives; an error in any member's share reaches the caller and leaves the team usable; a piece that
splits a piece of its own runs it on the caller. Built from the header alone, into a small test library."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from llmserve import kernels

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "team.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace team = llmserve::team;

// Each index of [0, n) with the thread-chunk it ran in (its chunk's first index), from a team or from at::parallel_for
std::vector<int64_t> chunks(int64_t n, bool with_team, int64_t throw_at) {
  std::vector<int64_t> first(n, -1), count(n, 0);
  std::mutex lock;
  auto piece = [&] {
    team::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      if (begin <= throw_at && throw_at < end) throw std::runtime_error("share " + std::to_string(begin) + " failed");
      std::lock_guard<std::mutex> guard(lock);
      for (int64_t i = begin; i < end; ++i) first[i] = begin, ++count[i];
    });
  };
  if (with_team)
    team::with_team(piece);
  else
    piece();
  for (int64_t c : count) TORCH_CHECK(c == 1, "an index ran ", c, " times");
  return first;
}

// Outer pieces whose shares each split an inner piece: how many inner indices ran, each once
int64_t nested(int64_t outer, int64_t inner) {
  std::atomic<int64_t> ran{0};
  team::with_team([&] {
    team::parallel_for(0, outer, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        team::parallel_for(0, inner, 1, [&](int64_t b, int64_t e) { ran += e - b; });
    });
  });
  return ran.load();
}

int64_t team_size() {
  int64_t size = 0;
  team::with_team([&] { size = team::active ? team::active->size() : 1; });
  return size;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunks", &chunks);
  m.def("nested", &nested);
  m.def("team_size", &team_size);
}
"""


@pytest.fixture(scope="module")
def team():
    """ATen's threading and pybind11 only (not torch/extension.h): a build of seconds, not half a minute."""
    folder = kernels.build_directory().parent / "team-test"
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "team_test.cpp"
    if not source.exists() or source.read_text() != _SOURCE:
        source.write_text(_SOURCE)
    header = Path(kernels.__file__).with_name("team.h")
    version = hashlib.sha256(header.read_bytes()).hexdigest()[:16]  # the build cache versions sources and flags only
    return cpp_extension.load("llmserve_team_test", [str(source)], build_directory=str(folder),
                              extra_cflags=["-O1", "-fopenmp", f"-DTEAM={version}"],
                              extra_include_paths=[str(header.parent)])


def test_a_team_runs_each_index_once_in_at_parallel_for_chunks(team):
    assert torch.get_num_threads() >= 2
    assert team.team_size() == torch.get_num_threads()
    for n in (2, 3, 7, 64, 1000):
        assert team.chunks(n, True, -1) == team.chunks(n, False, -1)


def test_an_error_in_any_share_reaches_the_caller_and_the_team_goes_on(team):
    n = 10
    for share in sorted(set(team.chunks(n, True, -1))):  # the caller's share first, then the other members'
        with pytest.raises(RuntimeError, match=f"share {share} failed"):
            team.chunks(n, True, share)
        assert team.chunks(n, True, -1) == team.chunks(n, False, -1)


def test_a_piece_inside_a_share_runs_on_its_caller(team):
    assert team.nested(4, 100) == 4 * 100
