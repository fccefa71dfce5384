// SPDX-License-Identifier: Apache-2.0
// A .safetensors file opened and its header checked: every tensor's dtype, shape and byte
// range, validated against each other and the file's size before anything is read, so that a
// truncated or malformed file fails with the file and tensor named instead of mid-load.
#ifndef TRAINSTREAM_DAEMON_SAFETENSORS_SAFETENSORS_FILE_H_
#define TRAINSTREAM_DAEMON_SAFETENSORS_SAFETENSORS_FILE_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"
#include "safetensors/file_source.h"

namespace trainstream::daemon {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as the file writes it: "BF16", "F32", "F16", "I8", ...
  uint32_t element_size = 0;
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t offset = 0;  // of the first byte, from the start of the file
  uint64_t bytes = 0;
};

// Bytes per element of a safetensors dtype name; INVALID_ARGUMENT for an unknown one.
absl::StatusOr<uint32_t> SafetensorsElementSize(std::string_view dtype);

class SafetensorsFile {
 public:
  // NOT_FOUND or PERMISSION_DENIED when it can't be opened; INVALID_ARGUMENT when its header
  // is malformed; DATA_LOSS when it is truncated. Each message names the file (and the tensor,
  // where one is at fault).
  // Headers of real checkpoints are tens of kilobytes; an optimizer's own checkpoint, which
  // lists every parameter, may need more (it passes its own limit).
  static constexpr uint64_t kDefaultMaxHeaderBytes = uint64_t{16} << 20;
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path,
                                              uint64_t max_header_bytes = kDefaultMaxHeaderBytes,
                                              const FileSource& source = Filesystem());

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return file_bytes_; }
  // In the order of their bytes in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;
  // The header's "__metadata__" (string values only, as the format says).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Reads `bytes` at file offset `offset`, retrying short reads; an error names the file.
  absl::Status Read(uint64_t offset, void* out, uint64_t bytes) const;
  // Which file this is and which version of it, whatever name it was opened by: device, inode,
  // size and modification time (two loads of one content are one base).
  std::string Identity() const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  ipc::UniqueFd fd_;
  uint64_t file_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;  // name to position in tensors_
  std::map<std::string, std::string> metadata_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SAFETENSORS_SAFETENSORS_FILE_H_
