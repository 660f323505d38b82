// A forward's two threads kept together over the whole layer stack (ExactLayerStack::forward, few rows).
//
// A one-row SmolLM2 forward on 2 cores spends about half its time in the products, which stream each weight once
// from memory, and half in work on one thread (attention's remainder, norms, rotation, the calls between): the
// second thread then waits in the OpenMP pool while the memory bus is idle (a Zen 4: the worker idle ~44 % of a
// one-row forward; each product started cold, 1-2 MB at 7-16 GB/s). With a team, the stack's thread hands the
// helper its share of each product and attention call, as at::parallel_for would, and between them the helper
// fetches the weights of the products ahead into the caches (warm), so that they are read from cache when their
// turn comes. The split of every range is at::parallel_for's for two threads, so each call's work and results are
// what they are without a team (the kernels' results do not depend on the split: tests/test_int4_kernel.py).
//
// Outside a team (one thread, a nested region, no team opened) parallel_for is at::parallel_for and warm does nothing.

#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>

namespace hierspec_team {

// what the helper is asked
enum : int { kIdle = 0, kTask = 1, kDone = 2, kStop = 3 };

// ranges of weights waiting to be fetched (a forward asks a layer ahead: a range per tensor of each product)
constexpr int kRanges = 64;
// bytes fetched between two looks at the task slot (~20 cache lines: the helper answers a task within ~100 ns)
constexpr int64_t kWarmChunk = 1280;
constexpr int64_t kLine = 64;

struct Team {
  std::atomic<int> state{kIdle};
  std::atomic<bool> helping{false};  // the helper has entered its loop: tasks may be handed to it
  const std::function<void(int64_t, int64_t)>* task = nullptr;
  int64_t begin = 0, end = 0;
  std::exception_ptr error;
  // the warm queue: a ring the stack's thread fills and the helper empties
  const char* starts[kRanges] = {};
  int64_t sizes[kRanges] = {};
  std::atomic<int64_t> posted{0}, taken{0};
  int64_t offset = 0;  // bytes of the range at `taken` fetched so far (helper only)
};

// the team whose stack thread this is (nullptr elsewhere, the helper included)
inline thread_local Team* current = nullptr;

// Queue `bytes` from `data` to be fetched into the caches by the helper while it has nothing else to do. Dropped
// when the queue is full (only a warm-up: nothing depends on it).
inline void warm(const void* data, int64_t bytes) {
  Team* team = current;
  if (team == nullptr || data == nullptr || bytes <= 0) return;
  const int64_t at = team->posted.load(std::memory_order_relaxed);
  if (at - team->taken.load(std::memory_order_acquire) >= kRanges) return;
  team->starts[at % kRanges] = static_cast<const char*>(data);
  team->sizes[at % kRanges] = bytes;
  team->posted.store(at + 1, std::memory_order_release);
}

// One chunk of the queued ranges fetched; false when none is waiting.
inline bool warm_chunk(Team& team) {
  const int64_t at = team.taken.load(std::memory_order_relaxed);
  if (at == team.posted.load(std::memory_order_acquire)) return false;
  const char* start = team.starts[at % kRanges];
  const int64_t size = team.sizes[at % kRanges];
  const int64_t stop = std::min(size, team.offset + kWarmChunk);
  for (int64_t b = team.offset; b < stop; b += kLine) _mm_prefetch(start + b, _MM_HINT_T0);
  team.offset = stop;
  if (stop == size) {
    team.offset = 0;
    team.taken.store(at + 1, std::memory_order_release);
  }
  return true;
}

// The helper's loop: a handed task when there is one, else a chunk of the warm queue, until told to stop.
inline void help(Team& team) {
  team.helping.store(true, std::memory_order_release);
  for (;;) {
    const int state = team.state.load(std::memory_order_acquire);
    if (state == kStop) return;
    if (state == kTask) {
      try {
        (*team.task)(team.begin, team.end);
      } catch (...) {
        team.error = std::current_exception();
      }
      team.state.store(kDone, std::memory_order_release);
    } else if (state == kDone || !warm_chunk(team)) {
      _mm_pause();
    }
  }
}

// Where the second of two threads starts in at::parallel_for(begin, end, grain, f) (end when one thread takes all):
// the chunks are ceil(range / threads) long, threads = min(2, ceil(range / grain)).
inline int64_t helper_begin(int64_t begin, int64_t end, int64_t grain) {
  const int64_t range = end - begin;
  if (range <= grain || range <= 1) return end;
  const int64_t threads = grain > 0 ? std::min<int64_t>(2, (range + grain - 1) / grain) : 2;
  return begin + (range + threads - 1) / threads;
}

// f over [begin, end) in chunks, as at::parallel_for(begin, end, grain, f) shares it out: in a team, the second of
// two chunks on the helper; else at::parallel_for itself.
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  Team* team = current;
  if (team == nullptr || !team->helping.load(std::memory_order_acquire)) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (begin >= end) return;
  const int64_t middle = helper_begin(begin, end, grain);
  if (middle == end) {
    f(begin, end);
    return;
  }
  team->task = &f;
  team->begin = middle;
  team->end = end;
  team->error = nullptr;
  team->state.store(kTask, std::memory_order_release);
  std::exception_ptr mine;
  try {
    f(begin, middle);
  } catch (...) {
    mine = std::current_exception();
  }
  while (team->state.load(std::memory_order_acquire) != kDone) _mm_pause();
  team->state.store(kIdle, std::memory_order_release);
  if (mine) std::rethrow_exception(mine);
  if (team->error) std::rethrow_exception(team->error);
}

// body() with this thread and a helper as a team where PyTorch's pool has exactly two threads and none is busy
// elsewhere; else body() alone, its calls shared out by at::parallel_for (with more threads a team of two would
// leave the rest idle). Whatever body throws is thrown here, after the helper has stopped.
template <class Body>
void with_team(const Body& body) {
  if (current != nullptr || at::in_parallel_region() || at::get_num_threads() != 2) {
    body();
    return;
  }
  Team team;
  at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
    if (end - begin == 2) {  // one thread after all: no helper to hand anything to
      body();
      return;
    }
    if (begin == 1) {
      help(team);
      return;
    }
    current = &team;
    try {
      body();
    } catch (...) {
      current = nullptr;
      team.state.store(kStop, std::memory_order_release);
      throw;
    }
    current = nullptr;
    team.state.store(kStop, std::memory_order_release);
  });
}

}  // namespace hierspec_team
