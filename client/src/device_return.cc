// SPDX-License-Identifier: Apache-2.0
#include "device_return.h"

#include "absl/strings/str_format.h"
#include "cuda_status.h"
#include "trainstream/cuda_transfer.h"

namespace trainstream::client {

#ifdef TRAINSTREAM_HAVE_CUDA
namespace {

absl::Status CheckTargets(const std::vector<std::shared_ptr<HostBuffer>>& sources,
                          const std::vector<DeviceTarget>& targets, size_t first_index) {
  if (sources.size() != targets.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d device targets for %d parameters", targets.size(), sources.size()));
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    if (targets[i].device_ptr == 0) continue;  // a parameter whose updates are not returned
    if (targets[i].bytes != sources[i]->size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter %d: the device tensor holds %d bytes, its buffer '%s' %d", first_index + i,
          targets[i].bytes, sources[i]->info().name, sources[i]->size()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceReturn>> DeviceReturn::Create(
    int device, std::vector<std::shared_ptr<HostBuffer>> sources,
    std::vector<DeviceTarget> targets) {
  if (absl::Status s = CheckTargets(sources, targets, 0); !s.ok()) return s;
  auto r = std::unique_ptr<DeviceReturn>(new DeviceReturn(device));
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  cudaStream_t stream = nullptr;
  if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags");
      !s.ok()) {
    return s;
  }
  r->stream_ = stream;
  if (absl::Status s = r->Extend(std::move(sources), std::move(targets)); !s.ok()) return s;
  return r;
}

absl::Status DeviceReturn::Extend(std::vector<std::shared_ptr<HostBuffer>> sources,
                                  std::vector<DeviceTarget> targets) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckTargets(sources, targets, sources_.size()); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  std::vector<void*> events;
  for (size_t i = 0; i < sources.size(); ++i) {
    cudaEvent_t event = nullptr;
    absl::Status made = CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                   "cudaEventCreateWithFlags");
    if (!made.ok()) {
      for (void* e : events) cudaEventDestroy(static_cast<cudaEvent_t>(e));
      return made;
    }
    events.push_back(event);
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    sources_.push_back(std::move(sources[i]));
    targets_.push_back(targets[i]);
    events_.push_back(events[i]);
    pending_.push_back(false);
  }
  return absl::OkStatus();
}

DeviceReturn::~DeviceReturn() {
  if (stream_ != nullptr) {
    cudaSetDevice(device_);
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  }
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status DeviceReturn::Copy(uint32_t index) {
  absl::MutexLock lock(&mu_);
  if (index >= sources_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("no parameter %d", index));
  }
  // The calling thread may be a fresh one: CUDA's current device is per thread.
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  const DeviceTarget& t = targets_[index];
  if (t.device_ptr == 0) return absl::OkStatus();  // not returned (paged from host memory)
  absl::Status copied = CopyToDevice(*sources_[index], 0, reinterpret_cast<void*>(t.device_ptr),
                                     t.bytes, stream_);
  if (!copied.ok()) return copied;
  if (absl::Status s = CudaStatus(
          cudaEventRecord(static_cast<cudaEvent_t>(events_[index]),
                          static_cast<cudaStream_t>(stream_)),
          "cudaEventRecord");
      !s.ok()) {
    return s;
  }
  pending_[index] = true;
  return absl::OkStatus();
}

absl::Status DeviceReturn::WaitOnStream(const std::vector<uint32_t>& indices, void* stream) {
  absl::MutexLock lock(&mu_);
  for (uint32_t i : indices) {
    if (i >= pending_.size()) return absl::InvalidArgumentError(absl::StrFormat("no parameter %d", i));
    if (!pending_[i]) continue;
    if (absl::Status s = CudaStatus(
            cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                static_cast<cudaEvent_t>(events_[i]), 0),
            "cudaStreamWaitEvent");
        !s.ok()) {
      return s;
    }
    pending_[i] = false;
  }
  return absl::OkStatus();
}

absl::Status DeviceReturn::Retarget(uint32_t index, DeviceTarget target) {
  absl::MutexLock lock(&mu_);
  if (index >= targets_.size()) return absl::InvalidArgumentError(absl::StrFormat("no parameter %d", index));
  if (target.device_ptr != 0 && target.bytes != sources_[index]->size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parameter %d: a device tensor of %d bytes cannot take its %d-byte buffer", index,
        target.bytes, sources_[index]->size()));
  }
  targets_[index] = target;
  return absl::OkStatus();
}

absl::Status DeviceReturn::Synchronize() {
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)),
                    "cudaStreamSynchronize");
}

#else  // !TRAINSTREAM_HAVE_CUDA

absl::StatusOr<std::unique_ptr<DeviceReturn>> DeviceReturn::Create(
    int, std::vector<std::shared_ptr<HostBuffer>>, std::vector<DeviceTarget>) {
  return absl::UnavailableError("this build of trainstream has no CUDA support");
}
absl::Status DeviceReturn::Extend(std::vector<std::shared_ptr<HostBuffer>>,
                                  std::vector<DeviceTarget>) {
  return absl::UnavailableError("no CUDA support");
}
DeviceReturn::~DeviceReturn() = default;
absl::Status DeviceReturn::Copy(uint32_t) { return absl::UnavailableError("no CUDA support"); }
absl::Status DeviceReturn::WaitOnStream(const std::vector<uint32_t>&, void*) {
  return absl::UnavailableError("no CUDA support");
}
absl::Status DeviceReturn::Retarget(uint32_t, DeviceTarget) {
  return absl::UnavailableError("no CUDA support");
}
absl::Status DeviceReturn::Synchronize() { return absl::UnavailableError("no CUDA support"); }

#endif

}  // namespace trainstream::client
