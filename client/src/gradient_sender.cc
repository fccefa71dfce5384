// SPDX-License-Identifier: Apache-2.0
#include "gradient_sender.h"

#include "absl/strings/str_format.h"
#include "trainstream/cuda_transfer.h"
#include "cuda_status.h"
#include "trainstream/status_macros.h"

namespace trainstream::client {

#ifdef TRAINSTREAM_HAVE_CUDA

absl::StatusOr<std::unique_ptr<GradientSender>> GradientSender::Create(int device, Post post) {
  std::string why;
  if (!CudaAvailable(&why)) return absl::UnavailableError(why);
  auto sender = std::unique_ptr<GradientSender>(new GradientSender(device, std::move(post)));
  sender->thread_ = std::thread([s = sender.get()] { s->Run(); });
  return sender;
}

GradientSender::~GradientSender() {
  Drain().IgnoreError();  // nothing left to report to: the optimizer is going away
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  for (void* e : all_events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

absl::StatusOr<void*> GradientSender::TakeEvent() {
  if (!free_events_.empty()) {
    void* e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  // Blocking sync: the thread sleeps on the copy instead of spinning a core the training
  // process's own threads need.
  cudaEvent_t event = nullptr;
  RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync),
      "cudaEventCreateWithFlags"));
  all_events_.push_back(event);
  return event;
}

absl::Status GradientSender::Send(uint64_t iteration, const std::vector<Copy>& copies,
                                  void* stream) {
  for (const Copy& c : copies) {
    if (c.bytes > c.buffer->size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter %d: a %d-byte gradient does not fit its %d-byte buffer '%s'", c.index,
          c.bytes, c.buffer->size(), c.buffer->info().name));
    }
  }
  if (copies.empty()) return absl::OkStatus();
  // The events belong to device_: a caller whose current device differs is switched for the
  // call and switched back.
  int caller_device = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&caller_device), "cudaGetDevice"));
  if (caller_device != device_) {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  }
  absl::Status sent = Enqueue(iteration, copies, stream);
  if (caller_device != device_) cudaSetDevice(caller_device);
  return sent;
}

absl::Status GradientSender::Enqueue(uint64_t iteration, const std::vector<Copy>& copies,
                                     void* stream) {
  Pending pending{nullptr, iteration, {}};
  pending.posts.reserve(copies.size());
  for (const Copy& c : copies) {
    RETURN_IF_ERROR(CopyToHost(*c.buffer, 0, c.device_src, c.bytes, stream));
    pending.posts.emplace_back(c.index, c.micro);
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(pending.event, TakeEvent());
  if (absl::Status s = CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(pending.event),
                                                  static_cast<cudaStream_t>(stream)),
                                  "cudaEventRecord");
      !s.ok()) {
    free_events_.push_back(pending.event);
    return s;
  }
  queue_.push_back(std::move(pending));
  return absl::OkStatus();
}

void GradientSender::Run() {
  cudaSetDevice(device_);  // the current device is per thread
  while (true) {
    Pending next;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GradientSender* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->stop_ || !s->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, and everything sent was rung
      next = std::move(queue_.front());
      queue_.pop_front();
      ++posting_;
    }
    absl::Status s = CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(next.event)),
                                "cudaEventSynchronize (gradients' copies to host memory)");
    if (s.ok()) {
      for (const auto& [index, micro] : next.posts) {
        absl::Status posted = post_(index, next.iteration, micro);
        if (!posted.ok() && s.ok()) s = posted;  // the rest of the batch still flows
      }
    }
    absl::MutexLock lock(&mu_);
    free_events_.push_back(next.event);
    --posting_;
    // The first failure is kept for Drain; later gradients still flow.
    if (!s.ok() && error_.ok()) error_ = s;
  }
}

absl::Status GradientSender::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](GradientSender* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
        return s->queue_.empty() && s->posting_ == 0;
      },
      this));
  absl::Status error = error_;
  error_ = absl::OkStatus();
  return error;
}

#else  // !TRAINSTREAM_HAVE_CUDA

absl::StatusOr<std::unique_ptr<GradientSender>> GradientSender::Create(int, Post) {
  return absl::UnavailableError("this build of trainstream has no CUDA support");
}
GradientSender::~GradientSender() = default;
absl::Status GradientSender::Send(uint64_t, const std::vector<Copy>&, void*) {
  return absl::UnavailableError("no CUDA support");
}
absl::Status GradientSender::Drain() { return absl::OkStatus(); }
absl::Status GradientSender::Enqueue(uint64_t, const std::vector<Copy>&, void*) {
  return absl::UnavailableError("no CUDA support");
}
void GradientSender::Run() {}
absl::StatusOr<void*> GradientSender::TakeEvent() {
  return absl::UnavailableError("no CUDA support");
}

#endif

}  // namespace trainstream::client
