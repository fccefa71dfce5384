// SPDX-License-Identifier: Apache-2.0
// Files a client opened with its own rights and handed to the daemon as descriptors
// (DataRequest.grant_files, SCM_RIGHTS), kept for its session until one request (LoadBase,
// SaveCheckpoint, LoadCheckpoint) uses them up. A daemon that runs as its own user cannot open
// a checkpoint its caller wrote with mode 0600; one that runs as root could open more than its
// caller may. With the caller's descriptors it reads exactly what the caller could, since the
// kernel checked the caller's rights when the caller opened them. Thread-safe.
#ifndef TRAINSTREAM_DAEMON_SESSIONS_GRANTED_FILES_H_
#define TRAINSTREAM_DAEMON_SESSIONS_GRANTED_FILES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ipc/unique_fd.h"
#include "safetensors/file_source.h"

namespace trainstream::daemon {

struct GrantedFile {
  ipc::UniqueFd fd;
  bool readable = false;
  bool writable = false;
};

// One grant's files by the names the client gave them (absolute paths it resolved). As a
// FileSource it answers only for those names: a file the client did not hand over is not
// found, whatever the daemon itself could open.
class FileGrant final : public FileSource {
 public:
  FileGrant() = default;
  FileGrant(FileGrant&&) = default;
  FileGrant& operator=(FileGrant&&) = default;

  const std::map<std::string, GrantedFile>& files() const { return files_; }

  absl::StatusOr<ipc::UniqueFd> OpenForReading(const std::string& path,
                                               uint64_t* bytes) const override;
  bool IsDirectory(const std::string& path) const override;
  bool Exists(const std::string& path) const override;
  absl::StatusOr<std::string> RealPath(const std::string& path) const override;

 private:
  friend class GrantedFiles;
  std::map<std::string, GrantedFile> files_;
};

class GrantedFiles {
 public:
  // Descriptors held for one session, and for all: each is a file table entry of the daemon's,
  // and a client must not be able to use them all up.
  static constexpr size_t kMaxFilesPerSession = 1024;
  static constexpr size_t kMaxFiles = 16384;
  explicit GrantedFiles(size_t max_files_per_session = kMaxFilesPerSession,
                        size_t max_files = kMaxFiles)
      : max_files_per_session_(max_files_per_session), max_files_(max_files) {}

  // Adds `fds`, one per name, to the session's grant `grant` (0: a new grant); returns the
  // grant's id. INVALID_ARGUMENT for a name that is not an absolute, normalized path, a name
  // given twice, a descriptor of something other than a regular file, or one opened with
  // O_PATH; NOT_FOUND for a grant of another session; RESOURCE_EXHAUSTED past the limits.
  // Nothing is added when any file is refused.
  absl::StatusOr<uint64_t> Add(const std::string& session_id, uint64_t grant,
                               const std::vector<std::string>& names,
                               std::vector<ipc::UniqueFd> fds);
  // Removes the session's grant `grant` and hands it over; NOT_FOUND when it has none by that id.
  absl::StatusOr<FileGrant> Take(const std::string& session_id, uint64_t grant);
  // Closes whatever the session's grants still hold.
  void SessionEnded(const std::string& session_id);
  size_t held_files() const;

 private:
  struct Pending {
    std::string session_id;
    FileGrant grant;
  };
  const size_t max_files_per_session_;
  const size_t max_files_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Pending> grants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> files_of_session_ ABSL_GUARDED_BY(mu_);
  size_t files_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_GRANTED_FILES_H_
