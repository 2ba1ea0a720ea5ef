// Work shared between torch's threads so that none waits long for another that lost its core.
//
// at::parallel_for gives each thread a fixed share of the items, and the region ends when the last share
// is done. On a served machine Redis, the client and the worker's event loop run on the same cores as
// torch's threads; whenever one of them takes a core, the thread it displaced finishes its share late and
// the other thread waits for it at the region's end. On 2 cores, a bf16 GEMM lost about twice the CPU
// share an interferer took (ops/bench/RESULTS.md, "Work sharing between torch's threads"). Here each thread still starts with its own
// contiguous share and walks it front to back (so a kernel can prefetch its next item), but a thread that
// runs out takes items from the back of the other shares, one at a time. Only the item a displaced thread
// holds is waited for. Which thread computes an item never changes its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace pagedq_parallel {

// One share's items not yet taken: [front, back), packed in one word so both ends move atomically.
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};
};

inline uint64_t pack(int64_t front, int64_t back) {
  return (static_cast<uint64_t>(front) << 32) | static_cast<uint32_t>(back);
}
inline int64_t front_of(uint64_t s) { return static_cast<int64_t>(s >> 32); }
inline int64_t back_of(uint64_t s) { return static_cast<int64_t>(s & 0xFFFFFFFFu); }

class Shares {
 public:
  // `bounds` [threads + 1]: share t holds items bounds[t] .. bounds[t + 1] - 1.
  explicit Shares(const std::vector<int64_t>& bounds) : count_(static_cast<int64_t>(bounds.size()) - 1) {
    shares_ = std::make_unique<Share[]>(count_);
    for (int64_t t = 0; t < count_; ++t) shares_[t].span.store(pack(bounds[t], bounds[t + 1]));
  }

  int64_t count() const { return count_; }

  // The next item of share t from its front, or -1 when it has none left.
  int64_t take_front(int64_t t) {
    auto& span = shares_[t].span;
    uint64_t s = span.load(std::memory_order_relaxed);
    while (front_of(s) < back_of(s))
      if (span.compare_exchange_weak(s, pack(front_of(s) + 1, back_of(s)))) return front_of(s);
    return -1;
  }

  // An item from the back of another share, or -1 when every share is empty.
  int64_t steal(int64_t self) {
    for (int64_t k = 1; k < count_; ++k) {
      auto& span = shares_[(self + k) % count_].span;
      uint64_t s = span.load(std::memory_order_relaxed);
      while (front_of(s) < back_of(s))
        if (span.compare_exchange_weak(s, pack(front_of(s), back_of(s) - 1))) return back_of(s) - 1;
    }
    return -1;
  }

  // Whether item i is still share t's next one (not taken from the back meanwhile): worth prefetching.
  bool is_next(int64_t t, int64_t i) const {
    const uint64_t s = shares_[t].span.load(std::memory_order_relaxed);
    return front_of(s) == i && i < back_of(s);
  }

 private:
  int64_t count_;
  std::unique_ptr<Share[]> shares_;
};

// Equal contiguous shares of n items, one per thread (as at::parallel_for splits them), at most n shares.
inline std::vector<int64_t> equal_bounds(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) bounds[t] = n * t / threads;
  return bounds;
}

// Runs body(item, next) for every item of the shares, on torch's threads: each thread its own share first,
// front to back, then the others' from their backs. `next` is the item this thread will most likely run
// after this one (-1 if none), for prefetching. `make_state()` builds per-thread scratch, passed to body
// as its first argument.
template <typename MakeState, typename Body>
void run_shares(const std::vector<int64_t>& bounds, const MakeState& make_state, const Body& body) {
  Shares shares(bounds);
  at::parallel_for(0, shares.count(), 1, [&](int64_t begin, int64_t end) {
    auto state = make_state();
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = shares.take_front(t); i >= 0;) {
        const int64_t after = shares.is_next(t, i + 1) ? i + 1 : -1;
        body(state, i, after);
        i = shares.take_front(t);
      }
      for (int64_t i = shares.steal(t); i >= 0; i = shares.steal(t)) body(state, i, int64_t(-1));
    }
  });
}

// run_shares over n items in equal shares, with no per-thread state.
template <typename Body>
void run_items(int64_t n, const Body& body) {
  if (n <= 0) return;
  run_shares(equal_bounds(n), [] { return 0; }, [&](int, int64_t i, int64_t next) { body(i, next); });
}

}  // namespace pagedq_parallel
