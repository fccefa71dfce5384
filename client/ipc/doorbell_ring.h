// SPDX-License-Identifier: Apache-2.0
// The doorbell: two single-producer/single-consumer rings of fixed-size messages in one shared
// segment (client to daemon, daemon to client), each with an eventfd to wake a sleeping reader.
//
// The layout is part of the contract between processes, like proto/. Each side treats the
// other's half as hostile: indices are free-running counters that the reader keeps privately
// and only publishes; a slot is always `index & (capacity - 1)`, so no value written by the peer
// can make a read leave the segment; a peer index that runs more than `capacity` ahead is
// reported as corruption. (This is why the ring is ours rather than boost::lockfree's, whose
// indices in shared memory would be trusted.)
#ifndef TRAINSTREAM_IPC_DOORBELL_RING_H_
#define TRAINSTREAM_IPC_DOORBELL_RING_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace trainstream::ipc {

// What a doorbell message announces. Values are stable across versions.
enum class DoorbellKind : uint32_t {
  kPing = 1,            // client -> daemon: answer with kPong carrying the same id and value
  kPong = 2,            // daemon -> client
  kGradientReady = 10,  // client -> daemon: `id`'s gradient slot holds step `step`
  kUpdateDone = 11,     // daemon -> client: `id`'s parameter slot holds step `step`'s update
  kGradConsumed = 12,   // daemon -> client: `id`'s gradient slot may be written again
  kReduceReady = 13,    // daemon -> a machine's rank 0: `id`'s reduce buffer holds this
                        // machine's summed gradient of `step`, to all-reduce across machines
  kReduced = 14,        // machine's rank 0 -> daemon: `id`'s reduce buffer holds every
                        // machine's sum; update it
  kNormContribution = 15,  // client -> daemon: `value` holds the bits of a double, the sum of
                           // squares of step `step`'s gradients this rank updates on its GPU,
                           // for the job's global norm (clipping, reported norm); sent before
                           // those parameters are posted without a gradient
  kError = 255,         // daemon -> client: `value` is a google.rpc code for request `id`
};

struct DoorbellMessage {
  uint32_t kind = 0;
  uint32_t flags = 0;
  uint64_t id = 0;
  uint64_t step = 0;
  uint64_t value = 0;
};
static_assert(sizeof(DoorbellMessage) == 32);

inline constexpr uint32_t kDoorbellMagic = 0x54534442;  // "TSDB"
inline constexpr uint32_t kDoorbellVersion = 1;
inline constexpr uint32_t kDoorbellCapacity = 16384;    // messages per direction

// Flags of a doorbell message.
inline constexpr uint32_t kFlagNoGradient = 1;  // kGradientReady: this rank has no gradient
inline constexpr uint32_t kFlagSkipped = 2;     // kUpdateDone: the step was skipped

// One direction's shared state. Each index sits on its own cache line.
struct alignas(64) RingControl {
  alignas(64) std::atomic<uint64_t> head;              // written by the producer
  alignas(64) std::atomic<uint64_t> tail;              // written by the consumer
  alignas(64) std::atomic<uint32_t> consumer_sleeping;  // written by the consumer
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct DoorbellSegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t capacity;
  uint32_t reserved;
};

// Bytes of a doorbell segment (header, two controls, two slot arrays), page-rounded.
size_t DoorbellSegmentBytes();

// Writes an empty header and rings into `segment` (DoorbellSegmentBytes() long). Daemon side.
void InitializeDoorbellSegment(void* segment);

enum class DoorbellSide { kDaemon, kClient };

// One side's view of a doorbell segment: it produces into one ring and consumes the other.
// Send() may be called from one thread at a time, Receive()/TryReceive() from one thread at a
// time (possibly another). Does not own the mapping or the eventfds.
class DoorbellEndpoint {
 public:
  // Checks the header. `wake_peer_fd` is written after a push when the peer sleeps;
  // `wake_self_fd` is what this side waits on.
  static absl::StatusOr<DoorbellEndpoint> Attach(void* segment, size_t bytes, DoorbellSide side,
                                                 int wake_peer_fd, int wake_self_fd);

  // Pushes one message and wakes the peer if it sleeps. RESOURCE_EXHAUSTED when the ring is
  // full (the peer is not reading); DATA_LOSS when the peer's index is corrupt.
  absl::Status Send(const DoorbellMessage& message);

  // Takes one message if there is one: true when `*out` was filled. DATA_LOSS when the peer
  // published an impossible index.
  absl::StatusOr<bool> TryReceive(DoorbellMessage* out);

  // Waits for one message: spins `spin_ns` first, then sleeps on the eventfd. `timeout_ms` -1
  // waits forever; DEADLINE_EXCEEDED when nothing came.
  absl::Status Receive(DoorbellMessage* out, int timeout_ms, int64_t spin_ns = 20000);

  // For event loops: call before sleeping on wake_self_fd(). Returns false when a message
  // arrived meanwhile (do not sleep). Call EndSleep() after waking.
  bool BeginSleep();
  void EndSleep();
  // Clears the eventfd's counter after a wake-up.
  void DrainWakeups();

  int wake_self_fd() const { return wake_self_fd_; }

 private:
  DoorbellEndpoint(RingControl* out_control, DoorbellMessage* out_slots, RingControl* in_control,
                   DoorbellMessage* in_slots, int wake_peer_fd, int wake_self_fd);

  RingControl* out_control_;
  DoorbellMessage* out_slots_;
  RingControl* in_control_;
  DoorbellMessage* in_slots_;
  int wake_peer_fd_;
  int wake_self_fd_;
  uint64_t out_head_ = 0;  // private copies: the shared ones are only published
  uint64_t in_tail_ = 0;
};

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_DOORBELL_RING_H_
