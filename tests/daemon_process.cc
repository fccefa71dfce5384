// SPDX-License-Identifier: Apache-2.0
#include "daemon_process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "gtest/gtest.h"
#include "trainstream/client.h"

extern char** environ;

namespace trainstream::testing {

DaemonProcess::DaemonProcess(std::vector<std::string> extra_args) {
  char pattern[] = "/tmp/tsd-cc-XXXXXX";
  directory_ = ::mkdtemp(pattern);
  socket_path_ = directory_ + "/d.sock";
  std::vector<std::string> args = {TRAINSTREAMD_PATH, "--socket=" + socket_path_,
                                   "--memory_budget=4G", "--log_level=warning"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    ADD_FAILURE() << "cannot start " << argv[0];
    return;
  }
  for (int i = 0; i < 500; ++i) {
    if (client::PingDaemon(socket_path_).ok()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "trainstreamd did not answer on " << socket_path_;
}

int DaemonProcess::Stop(int signal) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, signal);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

DaemonProcess::~DaemonProcess() {
  Stop(SIGTERM);
  std::filesystem::remove_all(directory_);
}

}  // namespace trainstream::testing
