// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_CHANNEL_H_
#define TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_CHANNEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ipc/doorbell_ring.h"
#include "ipc/shared_mapping.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

// Descriptors for a client to attach its end of a doorbell; owned by the receiver.
struct DoorbellGrant {
  ipc::UniqueFd segment;
  ipc::UniqueFd to_daemon;  // eventfd the client writes to wake the daemon
  ipc::UniqueFd to_client;  // eventfd the daemon writes to wake the client
  uint64_t bytes = 0;
};

// The daemon's end of one session's doorbell: the ring segment (memfd, reserved up front,
// size sealed), both eventfds and the daemon-side endpoint. Send() is serialised by a mutex
// since handlers on several threads may answer; receiving happens on the dispatcher thread.
class DoorbellChannel {
 public:
  static absl::StatusOr<std::unique_ptr<DoorbellChannel>> Create();

  // Duplicates of the descriptors, to pass to the client.
  absl::StatusOr<DoorbellGrant> Grant() const;

  absl::Status Send(const ipc::DoorbellMessage& message) ABSL_LOCKS_EXCLUDED(send_mu_);
  absl::StatusOr<bool> TryReceive(ipc::DoorbellMessage* out) { return endpoint_.TryReceive(out); }
  void DrainWakeups() { endpoint_.DrainWakeups(); }
  int wake_fd() const { return to_daemon_.get(); }

 private:
  DoorbellChannel(ipc::UniqueFd segment, ipc::SharedMapping mapping, ipc::UniqueFd to_daemon,
                  ipc::UniqueFd to_client, ipc::DoorbellEndpoint endpoint);

  ipc::UniqueFd segment_;
  ipc::SharedMapping mapping_;
  ipc::UniqueFd to_daemon_;
  ipc::UniqueFd to_client_;
  absl::Mutex send_mu_;
  ipc::DoorbellEndpoint endpoint_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_CHANNEL_H_
