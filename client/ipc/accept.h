// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_IPC_ACCEPT_H_
#define TRAINSTREAM_IPC_ACCEPT_H_

#include "ipc/unique_fd.h"

namespace trainstream::ipc {

// accept4() for a listener whose process may run out of descriptors. A connection that would
// leave fewer than 32 descriptors for the process's own work is closed at once. With none left
// (EMFILE/ENFILE), a poll loop would wake for the same pending connection forever: the spare
// descriptor is closed, the connection accepted and closed at once (its peer sees the
// connection end), and the spare taken again. Either way nothing spins.
class Acceptor {
 public:
  enum class Outcome { kAccepted, kShed, kNothing, kFailed };
  struct Result {
    Outcome outcome;
    UniqueFd fd;  // kAccepted only
    int error = 0;
  };

  Acceptor();
  // flags: accept4's (SOCK_CLOEXEC, SOCK_NONBLOCK).
  Result Accept(int listener, int flags);

 private:
  UniqueFd spare_;
};

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_ACCEPT_H_
