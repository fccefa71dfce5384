// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_TESTS_DAEMON_PROCESS_H_
#define TRAINSTREAM_TESTS_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

namespace trainstream::testing {

// The real trainstreamd on a socket in a fresh temporary directory; SIGTERM and reaped on
// destruction. Aborts the test if it does not come up.
class DaemonProcess {
 public:
  explicit DaemonProcess(std::vector<std::string> extra_args = {});
  ~DaemonProcess();
  const std::string& socket_path() const { return socket_path_; }
  // Sends `signal` and returns the exit status (as from waitpid).
  int Stop(int signal);

 private:
  std::string directory_;
  std::string socket_path_;
  pid_t pid_ = -1;
};

}  // namespace trainstream::testing

#endif  // TRAINSTREAM_TESTS_DAEMON_PROCESS_H_
