// SPDX-License-Identifier: Apache-2.0
// Starts the installed trainstreamd on a temporary socket, opens a session through the
// installed client library, writes a host buffer and reads it back by name.
//   consumer TRAINSTREAMD
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "trainstream/client.h"
#include "trainstream/version.h"

extern char** environ;

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "consumer: %s\n", what.c_str());
  return 1;
}

int Run(const std::string& daemon_path, const std::string& socket) {
  namespace client = trainstream::client;
  bool answered = false;
  for (int i = 0; i < 500 && !answered; ++i) {
    answered = client::PingDaemon(socket).ok();
    if (!answered) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!answered) return Fail(daemon_path + " did not answer on " + socket);
  client::SessionOptions options;
  options.socket_path = socket;
  options.job_id = "consumer";
  auto session = client::Session::Create(options);
  if (!session.ok()) return Fail(session.status().ToString());
  constexpr uint64_t kBytes = 1 << 20;
  auto buffer = (*session)->Allocate("weights", kBytes);
  if (!buffer.ok()) return Fail(buffer.status().ToString());
  for (uint64_t i = 0; i < kBytes; ++i) (*buffer)->data()[i] = static_cast<uint8_t>(i * 7);
  auto found = (*session)->Lookup("weights");
  if (!found.ok()) return Fail(found.status().ToString());
  for (uint64_t i = 0; i < kBytes; ++i) {
    if ((*found)->data()[i] != static_cast<uint8_t>(i * 7)) {
      return Fail("byte " + std::to_string(i) + " differs in the buffer found by name");
    }
  }
  if (auto closed = (*session)->Close(); !closed.ok()) return Fail(closed.ToString());
  std::printf("consumer: trainstream %s, session %s, %llu bytes through the daemon\n",
              trainstream::kTrainStreamVersion, (*session)->id().c_str(),
              static_cast<unsigned long long>(kBytes));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return Fail("usage: consumer TRAINSTREAMD");
  char pattern[] = "/tmp/ts-consumer-XXXXXX";
  if (::mkdtemp(pattern) == nullptr) return Fail(std::strerror(errno));
  const std::string directory = pattern;
  const std::string socket = directory + "/d.sock";
  std::vector<std::string> args = {argv[1], "--socket=" + socket, "--memory_budget=256M",
                                   "--log_level=warning"};
  std::vector<char*> daemon_argv;
  for (std::string& a : args) daemon_argv.push_back(a.data());
  daemon_argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[1], nullptr, nullptr, daemon_argv.data(), environ) != 0) {
    return Fail(std::string("cannot start ") + argv[1]);
  }
  const int result = Run(argv[1], socket);
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::filesystem::remove_all(directory);
  if (result == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    return Fail("trainstreamd did not stop cleanly on SIGTERM (status " +
                std::to_string(status) + ")");
  }
  return result;
}
