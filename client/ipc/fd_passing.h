// SPDX-License-Identifier: Apache-2.0
// Messages with file descriptors over a connected SOCK_SEQPACKET Unix socket (SCM_RIGHTS).
#ifndef TRAINSTREAM_IPC_FD_PASSING_H_
#define TRAINSTREAM_IPC_FD_PASSING_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::ipc {

// Largest datagram either side sends or accepts.
inline constexpr size_t kMaxDatagramBytes = 64 * 1024;
// Most descriptors one datagram carries.
inline constexpr size_t kMaxFdsPerDatagram = 8;

struct ReceivedMessage {
  std::string payload;
  std::vector<UniqueFd> fds;  // received with O_CLOEXEC
};

// Sends one datagram with `fds` attached (they stay owned by the caller). Blocks.
absl::Status SendMessage(int socket_fd, std::string_view payload, std::span<const int> fds = {});

// Receives one datagram, accepting at most `max_fds` descriptors: a peer that sends more, or
// any when `max_fds` is 0, has them closed by the kernel and gets an error here. Waits at most
// `timeout_ms` (-1: forever). End of stream is UNAVAILABLE ("peer closed the connection").
absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket_fd, size_t max_fds, int timeout_ms);

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_FD_PASSING_H_
