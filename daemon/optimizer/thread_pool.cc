// SPDX-License-Identifier: Apache-2.0
#include "optimizer/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>

#include "absl/synchronization/notification.h"

namespace trainstream::daemon {

ThreadPool::ThreadPool(size_t threads, bool pin) {
  if (threads == 0) threads = 1;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const bool know_cpus = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
  std::vector<int> cpus;
  for (int cpu = 0; know_cpus && cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  for (size_t i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { Work(); });
    if (pin && !cpus.empty()) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[i % cpus.size()], &one);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(one), &one);
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void ThreadPool::Work() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(size_t count, const std::function<void(size_t)>& fn) {
  if (count == 0) return;
  std::atomic<size_t> left{count};
  absl::Notification done;
  for (size_t i = 0; i < count; ++i) {
    Submit([&, i] {
      fn(i);
      if (left.fetch_sub(1) == 1) done.Notify();
    });
  }
  done.WaitForNotification();
}

}  // namespace trainstream::daemon
