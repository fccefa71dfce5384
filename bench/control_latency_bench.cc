// SPDX-License-Identifier: Apache-2.0
// Round trips through a real trainstreamd: a control RPC (Heartbeat over gRPC on the Unix
// socket) and a doorbell ping (shared-memory ring + eventfd wake-ups, both directions).
// Prints p50/p90/p99 in microseconds, and a one-line JSON record for bench/results/.
//
//   control_latency_bench [--socket=PATH] [--iterations=N]
// Without --socket it starts the trainstreamd built beside it on a temporary socket.
#include <signal.h>
#include <spawn.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "trainstream/client.h"

extern char** environ;

namespace {

struct Percentiles {
  double p50, p90, p99, mean;
};

Percentiles Summarise(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[static_cast<size_t>(q * (us.size() - 1))]; };
  double sum = 0;
  for (double v : us) sum += v;
  return {at(0.5), at(0.9), at(0.99), sum / us.size()};
}

template <typename Fn>
std::vector<double> Time(int iterations, Fn&& fn) {
  std::vector<double> out;
  out.reserve(iterations);
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    fn();
    out.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket;
  int iterations = 20000;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--socket=", 0) == 0) socket = arg.substr(9);
    if (arg.rfind("--iterations=", 0) == 0) iterations = std::stoi(arg.substr(13));
  }
  pid_t daemon = -1;
  std::string directory;
  if (socket.empty()) {
    char pattern[] = "/tmp/ts-bench-XXXXXX";
    directory = ::mkdtemp(pattern);
    socket = directory + "/d.sock";
    std::string binary = TRAINSTREAMD_PATH, flag = "--socket=" + socket, quiet = "--log_level=warning";
    char* args[] = {binary.data(), flag.data(), quiet.data(), nullptr};
    if (posix_spawn(&daemon, args[0], nullptr, nullptr, args, environ) != 0) {
      std::fprintf(stderr, "cannot start %s\n", args[0]);
      return 1;
    }
    for (int i = 0; i < 500 && !trainstream::client::PingDaemon(socket).ok(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  trainstream::client::SessionOptions options;
  options.socket_path = socket;
  options.job_id = "bench";
  auto session = trainstream::client::Session::Create(options);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", std::string(session.status().message()).c_str());
    return 1;
  }
  auto& s = **session;
  for (int i = 0; i < 1000; ++i) {  // warm-up
    (void)s.Heartbeat();
    (void)s.Ping();
  }
  Percentiles rpc = Summarise(Time(iterations, [&] { (void)s.Heartbeat(); }));
  Percentiles bell = Summarise(Time(iterations, [&] { (void)s.Ping(); }));
  utsname host{};
  ::uname(&host);
  std::printf("%-28s %10s %10s %10s %10s\n", "round trip (us)", "p50", "p90", "p99", "mean");
  std::printf("%-28s %10.1f %10.1f %10.1f %10.1f\n", "control RPC (Heartbeat)", rpc.p50, rpc.p90,
              rpc.p99, rpc.mean);
  std::printf("%-28s %10.1f %10.1f %10.1f %10.1f\n", "doorbell ping/pong", bell.p50, bell.p90,
              bell.p99, bell.mean);
  std::printf(
      "{\"bench\":\"control_latency\",\"host\":\"%s\",\"cores\":%u,\"iterations\":%d,"
      "\"rpc_us\":{\"p50\":%.2f,\"p90\":%.2f,\"p99\":%.2f},"
      "\"doorbell_us\":{\"p50\":%.2f,\"p90\":%.2f,\"p99\":%.2f}}\n",
      host.nodename, std::thread::hardware_concurrency(), iterations, rpc.p50, rpc.p90, rpc.p99,
      bell.p50, bell.p90, bell.p99);
  session->reset();
  if (daemon > 0) {
    ::kill(daemon, SIGTERM);
    ::waitpid(daemon, nullptr, 0);
    std::filesystem::remove_all(directory);
  }
  return 0;
}
