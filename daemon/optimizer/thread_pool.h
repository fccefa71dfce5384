// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_THREAD_POOL_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_THREAD_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace trainstream::daemon {

// A fixed set of worker threads running queued tasks in order of submission. The optimizer
// queues one task per chunk of a tensor, so several tensors' updates proceed at once and a
// large tensor spreads over every worker. Thread-safe.
class ThreadPool {
 public:
  // `threads` workers (at least one); with `pin`, worker i is bound to CPU i of the process's
  // affinity set, so a chunk's pages stay near the core that touches them.
  ThreadPool(size_t threads, bool pin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Submit(std::function<void()> task);
  // Runs fn(i) for i in [0, count) on the workers and returns when all are done. Must not be
  // called from a worker.
  void ParallelFor(size_t count, const std::function<void(size_t)>& fn);
  size_t size() const { return workers_.size(); }

 private:
  void Work();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_THREAD_POOL_H_
