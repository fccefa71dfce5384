// SPDX-License-Identifier: Apache-2.0
#include "caller_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ipc/checkpoint_temporaries.h"
#include "trainstream/status_macros.h"

namespace trainstream::client {
namespace {

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("cannot open ", path));
  }
  return std::string(resolved);
}

// Opens a regular file for reading without waiting on a FIFO; anything else is refused.
absl::StatusOr<CallerFile> OpenRegular(const std::string& real) {
  ipc::UniqueFd fd(::open(real.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("cannot open ", real));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", real));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(real, " is not a regular file"));
  }
  return CallerFile{real, std::move(fd)};
}

// `path` with its folder's links resolved and its own name kept: a Hugging Face cache links
// each file of a snapshot to a blob whose name says nothing of what it is, and the name is
// what tells an index from a shard.
absl::StatusOr<std::string> InRealFolder(const std::string& path) {
  const std::filesystem::path named(path);
  ASSIGN_OR_RETURN(std::string folder, RealPath(named.parent_path().empty()
                                                    ? std::string(".")
                                                    : named.parent_path().string()));
  return absl::StrCat(folder == "/" ? "" : folder, "/", named.filename().string());
}

std::string Folder(const std::string& real) {
  const size_t slash = real.rfind('/');
  return slash == 0 ? "/" : real.substr(0, slash);
}

}  // namespace

absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(const std::string& path) {
  CheckpointFiles out;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("cannot open ", path));
  std::string folder;
  if (S_ISDIR(st.st_mode)) {
    ASSIGN_OR_RETURN(folder, RealPath(path));
    out.path = folder;
  } else {
    ASSIGN_OR_RETURN(out.path, InRealFolder(path));
    ASSIGN_OR_RETURN(CallerFile named, OpenRegular(out.path));
    out.files.push_back(std::move(named));
    if (!absl::EndsWith(out.path, ".json")) return out;  // one file: nothing else to read
    folder = Folder(out.path);
  }
  // The index's shards, or a folder's checkpoint: the daemon picks what it needs from these.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (!absl::EndsWith(name, ".safetensors") && name != "model.safetensors.index.json") {
      continue;
    }
    const std::string file = absl::StrCat(folder == "/" ? "" : folder, "/", name);
    if (file == out.path) continue;
    absl::StatusOr<CallerFile> opened = OpenRegular(file);
    if (opened.ok()) out.files.push_back(*std::move(opened));
  }
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("listing ", folder));
  if (out.files.empty()) {
    return absl::NotFoundError(absl::StrCat(
        path, " holds neither model.safetensors nor model.safetensors.index.json"));
  }
  return out;
}

absl::StatusOr<CallerFile> OpenForReading(const std::string& path) {
  ASSIGN_OR_RETURN(std::string named, InRealFolder(path));
  return OpenRegular(named);
}

absl::StatusOr<CallerFile> CreateCheckpointTemporary(const std::string& path,
                                                     std::string* temporary) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint path '", path, "' must be absolute"));
  }
  ASSIGN_OR_RETURN(std::string real, InRealFolder(path));
  ipc::RemoveAbandonedTemporaries(real);
  *temporary = ipc::CheckpointTemporaryName(real);
  ipc::UniqueFd fd(::open(temporary->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("creating ", *temporary));
  return CallerFile{real, std::move(fd)};
}

absl::Status CommitCheckpoint(const std::string& temporary, const std::string& path) {
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const absl::Status failed =
        ErrnoStatus(errno, absl::StrCat("renaming the checkpoint to ", path));
    ::unlink(temporary.c_str());
    return failed;
  }
  const std::string folder = Folder(path);
  ipc::UniqueFd dir(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.valid()) ::fsync(dir.get());
  return absl::OkStatus();
}

}  // namespace trainstream::client
