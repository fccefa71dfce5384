// SPDX-License-Identifier: Apache-2.0
#include "ipc/checkpoint_temporaries.h"

#include <signal.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace trainstream::ipc {

std::string CheckpointTemporaryName(const std::string& path) {
  // The pid alone would do within one process; the random part keeps two writers apart.
  uint64_t random = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  if (::getrandom(&random, sizeof(random), GRND_NONBLOCK) != sizeof(random)) random ^= ::getpid();
  return absl::StrFormat("%s.tmp-%d-%016x", path, ::getpid(), random);
}

void RemoveAbandonedTemporaries(const std::string& path) {
  const std::filesystem::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(target.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || !entry.is_regular_file(ec)) continue;
    const std::string rest = name.substr(prefix.size());  // <pid>-<hex>
    const size_t dash = rest.find('-');
    if (dash == std::string::npos || rest.size() - dash - 1 != 16) continue;
    char* end = nullptr;
    const long pid = std::strtol(rest.c_str(), &end, 10);
    if (end != rest.c_str() + dash || pid <= 0) continue;
    if (rest.find_first_not_of("0123456789abcdef", dash + 1) != std::string::npos) continue;
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) {
      continue;  // a save in progress, here or in a live process
    }
    std::filesystem::remove(entry.path(), ec);
  }
}

}  // namespace trainstream::ipc
