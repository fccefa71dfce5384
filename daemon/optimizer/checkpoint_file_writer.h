// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_FILE_WRITER_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_FILE_WRITER_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace trainstream::daemon {

// Appends a checkpoint's bytes to a file open for writing at offset 0, then makes them durable.
//
// A save of gigabytes beside other jobs' steps should cost them as little CPU as it can. Through
// the page cache every byte is copied once by this thread and then flushed by the kernel's
// writeback threads, which run at their own priority and, on a small machine, take the cores
// the other jobs' steps wanted. So the bytes go with O_DIRECT where the file system takes it:
// staged into an aligned buffer here, at this thread's priority, and handed to the disk from
// there; only the last partial block goes through the page cache. Where O_DIRECT is refused
// (tmpfs on older kernels, some network file systems), the writer falls back to the page cache,
// starting the writeback of each piece and waiting for the one before, so that at most two
// pieces are dirty at once. The file's status flags are put back as they were on destruction:
// the descriptor may be shared with the client that opened it.
class CheckpointFileWriter {
 public:
  CheckpointFileWriter(int fd, std::string name);
  ~CheckpointFileWriter();
  CheckpointFileWriter(const CheckpointFileWriter&) = delete;
  CheckpointFileWriter& operator=(const CheckpointFileWriter&) = delete;

  absl::Status Write(const void* data, uint64_t bytes);

  // Writes what is still staged and fsyncs the file.
  absl::Status Finish();

  // Whether the bytes bypass the page cache (the file system took O_DIRECT).
  bool direct() const { return direct_; }

 private:
  absl::Status WriteStaged(uint64_t bytes);
  absl::Status WriteBuffered(const uint8_t* data, uint64_t bytes);
  void EndBufferedPiece();
  absl::Status LeaveDirectMode();

  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };

  const int fd_;
  const std::string name_;
  int original_flags_ = -1;
  bool direct_ = false;
  std::unique_ptr<uint8_t, FreeDeleter> staging_;
  uint64_t staged_ = 0;
  uint64_t written_ = 0;        // bytes in the file so far
  uint64_t piece_start_ = 0;    // where the buffered piece being written began
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_FILE_WRITER_H_
