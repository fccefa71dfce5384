// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_IPC_EVENT_SIGNAL_H_
#define TRAINSTREAM_IPC_EVENT_SIGNAL_H_

#include <unistd.h>

#include <cstdint>

namespace trainstream::ipc {

// Adds one to an eventfd's counter to wake whoever polls it. A full counter (EAGAIN) already
// means "wake up", so a failed write needs no handling.
inline void SignalEventFd(int fd) {
  uint64_t one = 1;
  ssize_t written = ::write(fd, &one, sizeof(one));
  static_cast<void>(written);
}

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_EVENT_SIGNAL_H_
