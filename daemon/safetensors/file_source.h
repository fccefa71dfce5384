// SPDX-License-Identifier: Apache-2.0
// Where the files of a checkpoint come from. The filesystem, opened by the daemon with its own
// identity; or the descriptors a client opened with its own rights and handed over on the data
// socket (dataplane/granted_files.h), so that a daemon running as another user reads exactly
// what the caller could, and nothing else. Readers of checkpoints take a FileSource and never
// call open() themselves.
#ifndef TRAINSTREAM_DAEMON_SAFETENSORS_FILE_SOURCE_H_
#define TRAINSTREAM_DAEMON_SAFETENSORS_FILE_SOURCE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

class FileSource {
 public:
  virtual ~FileSource() = default;
  // `path` opened for reading if it is a regular file (a FIFO or a device would block a request
  // or never end), with its size in `*bytes`. Errors name the file.
  virtual absl::StatusOr<ipc::UniqueFd> OpenForReading(const std::string& path,
                                                       uint64_t* bytes) const = 0;
  virtual bool IsDirectory(const std::string& path) const = 0;
  virtual bool Exists(const std::string& path) const = 0;
  // `path` with every symlink resolved: the name the files of a checkpoint are reported by.
  virtual absl::StatusOr<std::string> RealPath(const std::string& path) const = 0;
};

// The daemon's own view of the filesystem (the calling thread's filesystem identity).
const FileSource& Filesystem();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SAFETENSORS_FILE_SOURCE_H_
