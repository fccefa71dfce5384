// SPDX-License-Identifier: Apache-2.0
// Internal: copies each gradient from device memory into its daemon buffer on the caller's
// stream and rings its doorbell once the copy has landed, from a thread of its own. Backward
// never waits for PCIe, and no interpreter thread wakes per gradient (a Python poster thread
// took the GIL once per gradient: hundreds of times a step for LoRA's small tensors).
#ifndef TRAINSTREAM_CLIENT_SRC_GRADIENT_SENDER_H_
#define TRAINSTREAM_CLIENT_SRC_GRADIENT_SENDER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "trainstream/client.h"

namespace trainstream::client {

// Thread-safe. Owns its thread and its CUDA events; the destructor drains what was sent.
class GradientSender {
 public:
  // Rings parameter `index`'s doorbell (HostOptimizer::PostGradient).
  using Post = std::function<absl::Status(uint32_t index, uint64_t iteration, uint32_t micro)>;

  // UNAVAILABLE without CUDA.
  static absl::StatusOr<std::unique_ptr<GradientSender>> Create(int device, Post post);
  ~GradientSender();
  GradientSender(const GradientSender&) = delete;
  GradientSender& operator=(const GradientSender&) = delete;

  // One gradient: `bytes` at `device_src` go to the start of `buffer`, then parameter
  // `index`'s post of micro-step `micro`.
  struct Copy {
    const HostBuffer* buffer;
    uint32_t index;
    uint32_t micro;
    const void* device_src;
    uint64_t bytes;
  };

  // Enqueues `copies` on `stream` (a cudaStream_t), then their posts for `iteration` once all
  // of them have landed: one event and one wake-up of the thread for the batch. The device
  // memory must stay valid until the copies have run on `stream` (the caching allocator
  // guarantees it for memory freed to `stream` itself). INVALID_ARGUMENT, with nothing
  // enqueued, when any copy exceeds its buffer; a CUDA failure midway leaves the copies before
  // it enqueued and none of the batch posted (the iteration cannot complete, and says why).
  absl::Status Send(uint64_t iteration, const std::vector<Copy>& copies, void* stream);
  // Blocks until every post sent so far has been rung; returns (and forgets) the first
  // failure since the last Drain.
  absl::Status Drain();

 private:
  struct Pending {
    void* event;  // cudaEvent_t
    uint64_t iteration;
    std::vector<std::pair<uint32_t, uint32_t>> posts;  // (index, micro)
  };
  GradientSender(int device, Post post) : device_(device), post_(std::move(post)) {}
  // Send on device_.
  absl::Status Enqueue(uint64_t iteration, const std::vector<Copy>& copies, void* stream);
  void Run();
  absl::StatusOr<void*> TakeEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int device_;
  const Post post_;
  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  int posting_ ABSL_GUARDED_BY(mu_) = 0;  // taken off the queue, not yet rung
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<void*> free_events_ ABSL_GUARDED_BY(mu_);  // cudaEvent_t, reused
  std::vector<void*> all_events_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_GRADIENT_SENDER_H_
