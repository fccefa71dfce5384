// SPDX-License-Identifier: Apache-2.0
// Whether a client may read a file the daemon is asked to read for it. A system daemon runs as
// another user and could read files its caller can't: it reads one only when the caller could
// have, by the file's and its folders' permission bits.
#ifndef TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_
#define TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_

#include <string>

#include "absl/status/status.h"
#include "sessions/credentials.h"

namespace trainstream::daemon {

// OK when `peer` is the daemon's own user or root, or when every folder on the way to `path`
// lets it through and the file lets it read; PERMISSION_DENIED naming the path otherwise.
// Supplementary groups are not known from the socket: only the peer's primary group counts.
absl::Status CheckCallerMayRead(const std::string& path, const PeerCredentials& peer);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_
