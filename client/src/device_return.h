// SPDX-License-Identifier: Apache-2.0
// Internal: copies each parameter's updated value from its daemon buffer back into the model's
// device tensor on a stream of its own, the moment the daemon announces the update, and lets a
// reader's stream wait for exactly the copies it needs.
#ifndef TRAINSTREAM_CLIENT_SRC_DEVICE_RETURN_H_
#define TRAINSTREAM_CLIENT_SRC_DEVICE_RETURN_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "trainstream/client.h"
#include "trainstream/host_optimizer.h"

namespace trainstream::client {

// Thread-safe. Owns one non-blocking CUDA stream and one event per parameter; both are
// released (after the stream drains) on destruction.
class DeviceReturn {
 public:
  // UNAVAILABLE without CUDA; INVALID_ARGUMENT when a target's size differs from its buffer's.
  static absl::StatusOr<std::unique_ptr<DeviceReturn>> Create(
      int device, std::vector<std::shared_ptr<HostBuffer>> sources,
      std::vector<DeviceTarget> targets);
  ~DeviceReturn();
  DeviceReturn(const DeviceReturn&) = delete;
  DeviceReturn& operator=(const DeviceReturn&) = delete;

  // Enqueues parameter `index`'s copy and marks it pending for readers.
  absl::Status Copy(uint32_t index);
  // Makes `stream` wait for the pending copies among `indices` (then no longer pending: a
  // second stream reading the same parameters must be ordered after the first).
  absl::Status WaitOnStream(const std::vector<uint32_t>& indices, void* stream);
  // Parameters added to the optimizer: their sources and targets, in order after the others.
  absl::Status Extend(std::vector<std::shared_ptr<HostBuffer>> sources,
                      std::vector<DeviceTarget> targets);
  // A tensor moved (its storage was replaced): later copies go to the new address; address 0
  // stops returning that parameter's updates (its weights are read from host memory).
  absl::Status Retarget(uint32_t index, DeviceTarget target);
  size_t size() {
    absl::MutexLock lock(&mu_);
    return sources_.size();
  }
  // Blocks until every enqueued copy has landed.
  absl::Status Synchronize();

 private:
  explicit DeviceReturn(int device) : device_(device) {}

  const int device_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<HostBuffer>> sources_ ABSL_GUARDED_BY(mu_);
  std::vector<DeviceTarget> targets_ ABSL_GUARDED_BY(mu_);
  void* stream_ = nullptr;                             // cudaStream_t
  std::vector<void*> events_ ABSL_GUARDED_BY(mu_);     // cudaEvent_t, one per parameter
  std::vector<bool> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_DEVICE_RETURN_H_
