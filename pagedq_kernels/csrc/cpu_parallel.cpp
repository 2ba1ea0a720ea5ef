// A check of cpu_parallel.h's scheduler, for the tests: which thread ran each item.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cpu_ops.h"
#include "cpu_parallel.h"

// [n, 2]: how many times each of n items ran, and the thread (at::get_thread_num) that ran it last. With
// `hold_caller`, the calling thread (thread 0) waits on its first item (up to 10 s) until every other item is
// done: the rest of its share then runs only if the other threads take it over. (If another thread has
// taken the whole share before thread 0 starts, thread 0 runs nothing.)
torch::Tensor shares_trace(int64_t n, bool hold_caller) {
  TORCH_CHECK(n > 0, "shares_trace: n must be positive");
  auto trace = torch::zeros({n, 2}, torch::kLong);
  auto* t = trace.data_ptr<int64_t>();
  std::atomic<int64_t> done{0};
  bool held = false;  // written by thread 0 only
  pagedq_parallel::run_items(n, [&](int64_t i, int64_t) {
    if (hold_caller && !held && at::get_thread_num() == 0) {
      held = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (done.load() < n - 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    t[2 * i] += 1;
    t[2 * i + 1] = at::get_thread_num();
    done.fetch_add(1);
  });
  return trace;
}
