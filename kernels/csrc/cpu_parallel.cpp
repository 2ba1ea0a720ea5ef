// A check of cpu_parallel.h's scheduler, for the tests: which thread ran each item.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cpu_ops.h"
#include "cpu_parallel.h"

// [n, 2]: how many times each of n items ran, and the thread (at::get_thread_num) that ran it last. With
// `hold_first`, the thread that takes item 0 waits (up to 10 s) until every other item is done: its own
// share then finishes only if the other threads take it over.
torch::Tensor shares_trace(int64_t n, bool hold_first) {
  TORCH_CHECK(n > 0, "shares_trace: n must be positive");
  auto trace = torch::zeros({n, 2}, torch::kLong);
  auto* t = trace.data_ptr<int64_t>();
  std::atomic<int64_t> done{0};
  pagedq_parallel::run_items(n, [&](int64_t i, int64_t) {
    if (hold_first && i == 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (done.load() < n - 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    t[2 * i] += 1;
    t[2 * i + 1] = at::get_thread_num();
    done.fetch_add(1);
  });
  return trace;
}
