// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SERVICE_NOTIFY_H_
#define TRAINSTREAM_DAEMON_SERVICE_NOTIFY_H_

#include <string>

namespace trainstream::daemon {

// Tells the service manager (systemd's Type=notify, through $NOTIFY_SOCKET) where the daemon
// stands: ready once both sockets accept clients, stopping from the moment a drain starts. A
// no-op without $NOTIFY_SOCKET.
void NotifyReady(const std::string& status);
void NotifyStopping(const std::string& status);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SERVICE_NOTIFY_H_
