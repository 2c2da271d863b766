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
#include <tuple>
#include <vector>

namespace team = llmserve::team;

// Each index of [0, n) with the thread-chunk it ran in (its chunk's first index), from a team or from at::parallel_for;
// the team's size (1 without one); and the error the piece raised to this caller ("" if none)
std::tuple<std::vector<int64_t>, int64_t, std::string> chunks(int64_t n, bool with_team, int64_t throw_at) {
  std::vector<int64_t> first(n, -1), count(n, 0);
  std::mutex lock;
  int64_t size = 1;
  auto piece = [&] {
    size = team::active ? team::active->size() : 1;
    team::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      if (begin <= throw_at && throw_at < end) throw std::runtime_error("share " + std::to_string(begin) + " failed");
      std::lock_guard<std::mutex> guard(lock);
      for (int64_t i = begin; i < end; ++i) first[i] = begin, ++count[i];
    });
  };
  std::string error;
  try {
    if (with_team)
      team::with_team(piece);
    else
      piece();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (error.empty())
    for (int64_t c : count) TORCH_CHECK(c == 1, "an index ran ", c, " times");
  return {first, size, error};
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunks", &chunks);
  m.def("nested", &nested);
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


def whole_team(team, n: int, throw_at: int = -1) -> tuple[list[int], str]:
    """`chunks` from a team that all torch's threads joined. A worker the OS wakes after the team's patience (200 us:
    under load, seen once in CI) is left out and the piece runs on the threads that came, each index still once (the
    library checks it); such a run is tried again."""
    for _ in range(50):
        first, size, error = team.chunks(n, True, throw_at)
        if size == torch.get_num_threads():
            return first, error
    pytest.fail("no team of all torch's threads formed in 50 tries")


def test_a_team_runs_each_index_once_in_at_parallel_for_chunks(team):
    assert torch.get_num_threads() >= 2
    for n in (2, 3, 7, 64, 1000):
        plain, size, error = team.chunks(n, False, -1)
        assert size == 1 and not error
        assert whole_team(team, n) == (plain, "")


def test_an_error_in_any_share_reaches_the_caller_and_the_team_goes_on(team):
    n = 10
    plain = team.chunks(n, False, -1)[0]
    assert len(set(plain)) == min(n, torch.get_num_threads())  # a share each
    for share in sorted(set(plain)):  # the caller's share first, then the other members'
        assert whole_team(team, n, share)[1] == f"share {share} failed"
        assert whole_team(team, n) == (plain, "")


def test_a_piece_inside_a_share_runs_on_its_caller(team):
    assert team.nested(4, 100) == 4 * 100
