// SPDX-License-Identifier: Apache-2.0
// Files the client opens with its own rights for the daemon to read or write in its place
// (DataRequest.grant_files): a base's checkpoint, an optimizer checkpoint. The daemon may run as
// another user (the system service's) that cannot read a file saved with mode 0600, or as root,
// which could read more than the caller may; with the caller's descriptors it does neither.
#ifndef TRAINSTREAM_CLIENT_CALLER_FILES_H_
#define TRAINSTREAM_CLIENT_CALLER_FILES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::client {

struct CallerFile {
  std::string name;  // absolute, its folder's links resolved: the name the daemon knows it by
  ipc::UniqueFd fd;
};

// A checkpoint as LoadBase names it (a .safetensors file, an index, or their folder): its path
// as the daemon will know it (see CallerFile::name), and the files the daemon may need to read: the file itself; or the index (or
// model.safetensors) and every other .safetensors file beside it, since the daemon reads the
// index to learn which shards it needs. Files beside it that the caller can't open are left
// out: the daemon says so if it needs one. The named file itself must open.
struct CheckpointFiles {
  std::string path;
  std::vector<CallerFile> files;
};
absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(const std::string& path);

// `path` (absolute) opened for reading.
absl::StatusOr<CallerFile> OpenForReading(const std::string& path);

// A fresh temporary beside `path` (absolute), created for writing with the caller's rights, for
// the daemon to write a checkpoint into; a killed writer's leftovers are removed first. The
// file's name is `path` as the daemon will know it; the temporary's path is `*temporary`.
absl::StatusOr<CallerFile> CreateCheckpointTemporary(const std::string& path,
                                                     std::string* temporary);

// Renames the written temporary over `path` and makes the rename durable (fsync of the folder).
// On failure the temporary is removed.
absl::Status CommitCheckpoint(const std::string& temporary, const std::string& path);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_CALLER_FILES_H_
