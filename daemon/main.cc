// SPDX-License-Identifier: Apache-2.0
// trainstreamd: flags into DaemonOptions, a signal thread, and the Daemon. Nothing else.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include <sys/resource.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "config/daemon_options.h"
#include "daemon.h"
#include "service_notify.h"
#include "service_sockets.h"
#include "trainstream/version.h"

ABSL_FLAG(std::string, config, "", "config file (protobuf text format of DaemonConfig)");
ABSL_FLAG(std::optional<std::string>, socket, std::nullopt, "control socket path");
ABSL_FLAG(std::optional<std::string>, memory_budget, std::nullopt,
          "host memory all segments may reserve: 64G, 512M or 50%");
ABSL_FLAG(std::optional<std::string>, uid_quota, std::nullopt,
          "host memory one uid may reserve: 48G or a share of the budget (default "
          "90%; 0: no quota)");
ABSL_FLAG(std::optional<uint32_t>, threads, std::nullopt, "optimizer threads (0: one per core)");
ABSL_FLAG(std::optional<std::string>, log_level, std::nullopt, "debug, info, warning or error");
ABSL_FLAG(std::optional<uint32_t>, lease_ms, std::nullopt,
          "reclaim a session whose client is silent this long");
ABSL_FLAG(std::optional<uint32_t>, base_keep_warm_s, std::nullopt,
          "keep a shared base this long after its last user leaves (0: free it at once)");
ABSL_FLAG(std::optional<std::string>, gpu_pool_export, std::nullopt,
          "how GPU pools are shared: auto (VMM descriptors, legacy IPC where unavailable) or "
          "legacy_ipc");
ABSL_FLAG(std::optional<std::string>, metrics_listen, std::nullopt,
          "serve Prometheus metrics at GET /metrics on HOST:PORT (127.0.0.1:9478, [::1]:9478, "
          ":9478 for every interface; port 0: any free one); off by default");
ABSL_FLAG(int, parent_pid, 0,
          "embedded mode: shut down when this process (the one that started us) is gone");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the trainstream host-memory and optimizer daemon\n"
      "usage: trainstreamd [--config=FILE] [--socket=PATH] [flags]; a flag given here wins over "
      "the config file");
  // Abseil's --help lists the flags of files named after the program by default, and ours live
  // in main.cc: it printed "No flags matched". It lists ours (not Abseil's own) instead, and
  // --version prints the release.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "daemon/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] {
    return std::string("trainstreamd ") + trainstream::kTrainStreamVersion + "\n";
  };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);

  trainstream::daemon::DaemonFlags flags;
  flags.config_path = absl::GetFlag(FLAGS_config);
  flags.socket_path = absl::GetFlag(FLAGS_socket);
  flags.memory_budget = absl::GetFlag(FLAGS_memory_budget);
  flags.uid_quota = absl::GetFlag(FLAGS_uid_quota);
  flags.threads = absl::GetFlag(FLAGS_threads);
  flags.log_level = absl::GetFlag(FLAGS_log_level);
  flags.lease_ms = absl::GetFlag(FLAGS_lease_ms);
  flags.base_keep_warm_s = absl::GetFlag(FLAGS_base_keep_warm_s);
  flags.gpu_pool_export = absl::GetFlag(FLAGS_gpu_pool_export);
  flags.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  auto options = trainstream::daemon::LoadDaemonOptions(flags);
  if (!options.ok()) {
    std::fprintf(stderr, "trainstreamd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }

  // Block the stop signals before any thread starts, so only the waiter below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  // Every client holds a control and a data connection: the descriptor limit is raised to what
  // the system allows (max_connections_per_uid keeps one user from taking them all).
  if (rlimit files{}; ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }

  // Sockets a service manager made (deploy/trainstreamd.socket) are served where it listens,
  // in place of the configured path.
  auto inherited = trainstream::daemon::TakeServiceSockets();
  if (!inherited.ok()) {
    std::fprintf(stderr, "trainstreamd: %s\n", std::string(inherited.status().message()).c_str());
    return 2;
  }
  trainstream::ipc::UniqueFd control_listener, data_listener;
  if (inherited->has_value()) {
    trainstream::daemon::ServiceSockets& sockets = **inherited;
    if (sockets.control_path != options->socket_path) {
      std::fprintf(stderr,
                   "trainstreamd: serving the sockets the service manager passed, at %s (the "
                   "configured %s is not used)\n",
                   sockets.control_path.c_str(), options->socket_path.c_str());
    }
    options->socket_path = sockets.control_path;
    options->data_socket_path = sockets.data_path;
    control_listener = std::move(sockets.control);
    data_listener = std::move(sockets.data);
  }
  const bool activated = control_listener.valid();
  auto daemon = trainstream::daemon::Daemon::Create(*options, std::move(control_listener),
                                                    std::move(data_listener));
  if (!daemon.ok()) {
    std::fprintf(stderr, "trainstreamd: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  trainstream::daemon::NotifyReady(absl::StrCat("serving ", options->socket_path,
                                                activated ? " (socket-activated)" : ""));
  std::thread signal_waiter([&] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    trainstream::daemon::NotifyStopping(absl::StrCat("draining (", strsignal(signal), ")"));
    (*daemon)->Shutdown();
  });
  // An embedded daemon must not outlive the training process that started it, even when that
  // process is SIGKILLed and runs no exit handler.
  const int parent_pid = absl::GetFlag(FLAGS_parent_pid);
  std::thread parent_watch;
  if (parent_pid > 0) {
    parent_watch = std::thread([&] {
      while (getppid() == parent_pid) {
        if ((*daemon)->WaitFor(absl::Milliseconds(250))) return;
      }
      trainstream::daemon::NotifyStopping("draining (the parent process ended)");
      (*daemon)->Shutdown();
    });
  }
  (*daemon)->Wait();
  if (parent_watch.joinable()) parent_watch.join();
  signal_waiter.detach();  // may still be in sigwait if the daemon stopped on its own
  daemon->reset();
  return 0;
}
