// SPDX-License-Identifier: Apache-2.0
#include "ipc/doorbell_ring.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>

#include "trainstream/status_macros.h"

namespace trainstream::ipc {
namespace {

constexpr size_t kMask = kDoorbellCapacity - 1;
static_assert((kDoorbellCapacity & kMask) == 0, "capacity must be a power of two");

// Offsets inside the segment: header | control to-daemon | control to-client | slots | slots.
constexpr size_t kControlOffset = 64;
constexpr size_t kSlotsOffset = kControlOffset + 2 * sizeof(RingControl);
constexpr size_t kSlotsBytes = sizeof(DoorbellMessage) * kDoorbellCapacity;

RingControl* ControlAt(void* segment, int ring) {
  return reinterpret_cast<RingControl*>(static_cast<uint8_t*>(segment) + kControlOffset +
                                        ring * sizeof(RingControl));
}
DoorbellMessage* SlotsAt(void* segment, int ring) {
  return reinterpret_cast<DoorbellMessage*>(static_cast<uint8_t*>(segment) + kSlotsOffset +
                                            ring * kSlotsBytes);
}
constexpr int kToDaemon = 0;
constexpr int kToClient = 1;

}  // namespace

size_t DoorbellSegmentBytes() {
  size_t raw = kSlotsOffset + 2 * kSlotsBytes;
  size_t page = 4096;
  return (raw + page - 1) / page * page;
}

void InitializeDoorbellSegment(void* segment) {
  std::memset(segment, 0, DoorbellSegmentBytes());
  auto* header = static_cast<DoorbellSegmentHeader*>(segment);
  header->magic = kDoorbellMagic;
  header->version = kDoorbellVersion;
  header->capacity = kDoorbellCapacity;
  for (int ring : {kToDaemon, kToClient}) {
    RingControl* control = new (ControlAt(segment, ring)) RingControl;
    control->head.store(0);
    control->tail.store(0);
    control->consumer_sleeping.store(0);
  }
}

absl::StatusOr<DoorbellEndpoint> DoorbellEndpoint::Attach(void* segment, size_t bytes,
                                                          DoorbellSide side, int wake_peer_fd,
                                                          int wake_self_fd) {
  if (segment == nullptr || bytes < DoorbellSegmentBytes()) {
    return absl::InvalidArgumentError("doorbell segment is smaller than the ring layout");
  }
  auto* header = static_cast<const DoorbellSegmentHeader*>(segment);
  if (header->magic != kDoorbellMagic || header->version != kDoorbellVersion ||
      header->capacity != kDoorbellCapacity) {
    return absl::FailedPreconditionError(
        "doorbell segment has another layout version (client and daemon versions differ)");
  }
  int out = side == DoorbellSide::kClient ? kToDaemon : kToClient;
  int in = side == DoorbellSide::kClient ? kToClient : kToDaemon;
  DoorbellEndpoint endpoint(ControlAt(segment, out), SlotsAt(segment, out), ControlAt(segment, in),
                            SlotsAt(segment, in), wake_peer_fd, wake_self_fd);
  // Resume where the shared indices stand, so a re-attached endpoint neither replays nor skips.
  endpoint.out_head_ = endpoint.out_control_->head.load(std::memory_order_acquire);
  endpoint.in_tail_ = endpoint.in_control_->tail.load(std::memory_order_acquire);
  return endpoint;
}

DoorbellEndpoint::DoorbellEndpoint(RingControl* out_control, DoorbellMessage* out_slots,
                                   RingControl* in_control, DoorbellMessage* in_slots,
                                   int wake_peer_fd, int wake_self_fd)
    : out_control_(out_control),
      out_slots_(out_slots),
      in_control_(in_control),
      in_slots_(in_slots),
      wake_peer_fd_(wake_peer_fd),
      wake_self_fd_(wake_self_fd) {}

absl::Status DoorbellEndpoint::Send(const DoorbellMessage& message) {
  uint64_t tail = out_control_->tail.load(std::memory_order_acquire);
  if (tail > out_head_) return absl::DataLossError("doorbell peer published an impossible index");
  if (out_head_ - tail >= kDoorbellCapacity) {
    return absl::ResourceExhaustedError("doorbell ring is full: the peer is not reading");
  }
  out_slots_[out_head_ & kMask] = message;
  ++out_head_;
  out_control_->head.store(out_head_, std::memory_order_release);
  // Pairs with the fence in BeginSleep(): either the sleeper sees the new head, or we see it
  // sleeping and wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (out_control_->consumer_sleeping.load(std::memory_order_relaxed) != 0) {
    uint64_t one = 1;
    if (::write(wake_peer_fd_, &one, sizeof(one)) < 0 && errno != EAGAIN) {
      return ErrnoStatus(errno, "waking the doorbell peer");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> DoorbellEndpoint::TryReceive(DoorbellMessage* out) {
  uint64_t head = in_control_->head.load(std::memory_order_acquire);
  if (head == in_tail_) return false;
  if (head < in_tail_ || head - in_tail_ > kDoorbellCapacity) {
    return absl::DataLossError("doorbell peer published an impossible index");
  }
  *out = in_slots_[in_tail_ & kMask];
  ++in_tail_;
  in_control_->tail.store(in_tail_, std::memory_order_release);
  return true;
}

bool DoorbellEndpoint::BeginSleep() {
  in_control_->consumer_sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (in_control_->head.load(std::memory_order_acquire) != in_tail_) {
    in_control_->consumer_sleeping.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void DoorbellEndpoint::EndSleep() {
  in_control_->consumer_sleeping.store(0, std::memory_order_relaxed);
}

void DoorbellEndpoint::DrainWakeups() {
  uint64_t count;
  while (::read(wake_self_fd_, &count, sizeof(count)) == sizeof(count)) {
  }
}

absl::Status DoorbellEndpoint::Receive(DoorbellMessage* out, int timeout_ms, int64_t spin_ns) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::nanoseconds(spin_ns);
  while (true) {
    ASSIGN_OR_RETURN(bool got, TryReceive(out));
    if (got) return absl::OkStatus();
    if (Clock::now() < spin_until) continue;
    if (!BeginSleep()) continue;
    int wait_ms = -1;
    if (timeout_ms >= 0) {
      auto elapsed =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      if (elapsed >= timeout_ms) {
        EndSleep();
        return absl::DeadlineExceededError("no doorbell message in time");
      }
      wait_ms = static_cast<int>(timeout_ms - elapsed);
    }
    pollfd pfd{wake_self_fd_, POLLIN, 0};
    int ready = ::poll(&pfd, 1, wait_ms);
    EndSleep();
    if (ready < 0 && errno != EINTR) return ErrnoStatus(errno, "waiting for the doorbell");
    DrainWakeups();
  }
}

}  // namespace trainstream::ipc
