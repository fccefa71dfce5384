// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the doorbell ring under a hostile peer. The input is a script run against
// both endpoints of one segment: sends and receives on either side, interleaved with writes of
// arbitrary words anywhere in the shared segment (indices, sleeping flags, slots, the header),
// as a peer process could. Every call must return a status (DATA_LOSS for an impossible index,
// RESOURCE_EXHAUSTED for a full ring) and never touch memory outside the segment, which ASan
// guards: the segment is its own allocation, exactly DoorbellSegmentBytes() long.
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "ipc/doorbell_ring.h"

namespace {

using trainstream::ipc::DoorbellEndpoint;
using trainstream::ipc::DoorbellMessage;
using trainstream::ipc::DoorbellSide;

struct EventFd {
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  EventFd() {
    if (fd < 0) std::abort();
  }
  ~EventFd() { ::close(fd); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static EventFd to_daemon, to_client;
  const size_t bytes = trainstream::ipc::DoorbellSegmentBytes();
  // Aligned as a mapping's start is for the cache-line controls; the size is page-rounded,
  // so ASan's bounds are the segment's own.
  std::unique_ptr<uint8_t, decltype(&std::free)> segment(
      static_cast<uint8_t*>(std::aligned_alloc(64, bytes)), &std::free);
  trainstream::ipc::InitializeDoorbellSegment(segment.get());
  FuzzedDataProvider in(data, size);
  std::optional<DoorbellEndpoint> sides[2];
  auto attach = [&](int side) {
    absl::StatusOr<DoorbellEndpoint> e = DoorbellEndpoint::Attach(
        segment.get(), bytes, side == 0 ? DoorbellSide::kDaemon : DoorbellSide::kClient,
        side == 0 ? to_client.fd : to_daemon.fd, side == 0 ? to_daemon.fd : to_client.fd);
    if (e.ok()) {
      sides[side].emplace(std::move(*e));
    } else {
      sides[side].reset();
    }
  };
  attach(0);
  attach(1);
  for (int ops = 0; ops < 4096 && in.remaining_bytes() > 0; ++ops) {
    const int side = in.ConsumeBool() ? 1 : 0;
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 0: {  // the peer writes a word anywhere in the segment
        const size_t at = in.ConsumeIntegralInRange<size_t>(0, bytes / 8 - 1) * 8;
        const uint64_t word = in.ConsumeIntegral<uint64_t>();
        std::memcpy(segment.get() + at, &word, sizeof(word));
        break;
      }
      case 1: {  // a burst of sends (a full ring must be refused, not overwritten)
        const int n = in.ConsumeIntegralInRange<int>(1, 64);
        for (int i = 0; sides[side] && i < n; ++i) {
          DoorbellMessage m;
          m.kind = in.ConsumeIntegral<uint32_t>();
          m.id = static_cast<uint64_t>(i);
          if (!sides[side]->Send(m).ok()) break;
        }
        break;
      }
      case 2: {  // drain what can be read
        const int n = in.ConsumeIntegralInRange<int>(1, 64);
        DoorbellMessage m;
        for (int i = 0; sides[side] && i < n; ++i) {
          absl::StatusOr<bool> got = sides[side]->TryReceive(&m);
          if (!got.ok() || !*got) break;
        }
        break;
      }
      case 3:  // a sleep and a wake-up, as an event loop does them
        if (sides[side]) {
          if (sides[side]->BeginSleep()) sides[side]->EndSleep();
          sides[side]->DrainWakeups();
        }
        break;
      case 4:  // attach again, as a restarted process does, over whatever the segment holds
        attach(side);
        break;
    }
  }
  return 0;
}
