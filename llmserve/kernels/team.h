// torch's threads held in one parallel region for a whole decode step (decode_layer.cpp), its products and
// attentions handed to them through a flag each instead of a fork and a join each.
//
// Why: a small model's step is ~150 parallel pieces (SmolLM2: four products and an attention a layer, 30 layers),
// each a few microseconds to tens of them. Each `at::parallel_for` is an OpenMP fork and join, whose start and join
// cost a noticeable share of so short a piece, most where the cores sit on two dies
// (docs/performance.md, "The one-call decode step"). Here the other threads stay in the step's region: a piece is posted as one store to a
// line they watch, and each reports on a line of its own (a barrier of two flags).
//
// The split of each piece is `at::parallel_for`'s (contiguous chunks by thread index); a team that a late worker
// missed (`close`) splits among the threads that came. Every product and attention computes the same bits either
// way: their rows and tasks do not depend on the thread or chunk that runs them. Code that is not handed to the team
// (an op reached through the dispatcher, oneDNN) runs on the calling thread, as any `at::parallel_for` inside a region
// does: the stack holds a team only for steps whose every product is one of ours.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLMSERVE_TEAM_PAUSE() _mm_pause()
#else
#define LLMSERVE_TEAM_PAUSE() ((void)0)
#endif

namespace llmserve::team {

// Spins until `ready()`; past 16384 pauses (far longer than the gaps between a step's products) it yields
// the core between looks, so a thread whose partner was descheduled (more threads than cores) does not hold it
template <typename Ready>
void wait_until(const Ready& ready) {
  for (int spins = 0; !ready();) {
    if (spins < (1 << 14)) {
      ++spins;
      LLMSERVE_TEAM_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
}

class Team {
 public:
  explicit Team(int64_t wanted) : done_(static_cast<size_t>(wanted)), errors_(static_cast<size_t>(wanted)) {}

  int64_t size() const { return size_; }

  // A worker's arrival: its index in the team, or -1 once the team has closed (it came too late: it leaves)
  int64_t join() {
    const int64_t before = arrived_.fetch_add(1, std::memory_order_acq_rel);
    return before & kClosed ? -1 : before + 1;
  }

  // The caller's: waits (at most `patience`) for the workers, then closes the team to latecomers
  void close(int64_t wanted, std::chrono::microseconds patience) {
    const auto deadline = std::chrono::steady_clock::now() + patience;
    wait_until([&] {
      return (arrived_.load(std::memory_order_acquire) & ~kClosed) >= wanted - 1 ||
             std::chrono::steady_clock::now() >= deadline;
    });
    size_ = 1 + (arrived_.fetch_or(kClosed, std::memory_order_acq_rel) & ~kClosed);
  }

  // fn(index, size) on every member, the caller as index 0; returns when all are done, rethrowing a member's error.
  // Called again from inside the caller's own share (a piece that splits a piece of its own), it runs every share
  // there in turn: the members are busy with the outer piece.
  template <typename Fn>
  void run(const Fn& fn) {
    if (running_) {
      for (int64_t i = 0; i < size_; ++i) fn(i, size_);
      return;
    }
    running_ = true;
    if (size_ > 1) {
      task_ = &fn;
      call_ = [](const void* f, int64_t index, int64_t size) { (*static_cast<const Fn*>(f))(index, size); };
      posted_.value.store(++epoch_, std::memory_order_release);
    }
    std::exception_ptr error;
    try {
      fn(0, size_);
    } catch (...) {
      error = std::current_exception();
    }
    for (int64_t i = 1; i < size_; ++i)
      wait_until([&] { return done_[i].value.load(std::memory_order_acquire) == epoch_; });
    running_ = false;
    for (int64_t i = 1; i < size_ && !error; ++i) std::swap(error, errors_[i]);
    if (error) std::rethrow_exception(error);
  }

  // A worker's loop: each posted piece, until `stop`
  void serve(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t posted;
      wait_until([&] { return (posted = posted_.value.load(std::memory_order_acquire)) != seen; });
      if (posted == kStop) return;
      seen = posted;
      try {
        call_(task_, index, size_);
      } catch (...) {
        errors_[index] = std::current_exception();
      }
      done_[index].value.store(posted, std::memory_order_release);
    }
  }

  void stop() { posted_.value.store(kStop, std::memory_order_release); }

 private:
  static constexpr int64_t kClosed = int64_t{1} << 40;
  static constexpr uint64_t kStop = ~uint64_t{0};
  struct alignas(64) Flag {  // a line of its own: a flag's writes move no other flag's line
    std::atomic<uint64_t> value{0};
  };

  Flag posted_;
  std::atomic<int64_t> arrived_{0};
  int64_t size_ = 1;
  uint64_t epoch_ = 0;
  bool running_ = false;  // a piece is out (the caller's own flag: only the caller posts)
  const void* task_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  std::vector<Flag> done_;
  std::vector<std::exception_ptr> errors_;
};

// The team of the step running on this thread (set on its calling thread only)
inline thread_local Team* active = nullptr;

// `at::parallel_for` for our kernels: through the active team where there is one, with the same chunks
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = active;
  if (team == nullptr || team->size() < 2 || end - begin <= grain) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  team->run([&](int64_t index, int64_t size) {
    const int64_t threads = std::min<int64_t>(size, (end - begin + grain - 1) / std::max<int64_t>(grain, 1));
    const int64_t chunk = (end - begin + threads - 1) / threads;
    const int64_t first = begin + index * chunk;
    if (index < threads && first < end) f(first, std::min(end, first + chunk));
  });
}

// Runs `body` with torch's threads held as a team, where there are two or more and none is held yet
template <typename Body>
void with_team(const Body& body) {
  const int64_t wanted = at::get_num_threads();
  if (wanted < 2 || active != nullptr || at::in_parallel_region()) {
    body();
    return;
  }
  Team team(wanted);
  std::exception_ptr error;
  at::parallel_for(0, wanted, 1, [&](int64_t index, int64_t) {
    if (index != 0) {
      const int64_t member = team.join();
      if (member > 0) team.serve(member);
      return;
    }
    team.close(wanted, std::chrono::microseconds(200));
    active = &team;
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    active = nullptr;
    team.stop();
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace llmserve::team
