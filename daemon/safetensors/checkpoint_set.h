// SPDX-License-Identifier: Apache-2.0
// A checkpoint as Hugging Face writes it: one .safetensors file, or shards listed by a
// model.safetensors.index.json. Every file is opened and its header checked, and the index is
// checked against the shards, before a byte of tensor data is read.
#ifndef TRAINSTREAM_DAEMON_SAFETENSORS_CHECKPOINT_SET_H_
#define TRAINSTREAM_DAEMON_SAFETENSORS_CHECKPOINT_SET_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "safetensors/file_source.h"
#include "safetensors/safetensors_file.h"

namespace trainstream::daemon {

struct CheckpointTensor {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

class CheckpointSet {
 public:
  // `path` is a .safetensors file, a .safetensors.index.json, or a directory holding either
  // model.safetensors or model.safetensors.index.json.
  // Every file comes from `source`.
  static absl::StatusOr<CheckpointSet> Open(const std::string& path,
                                            const FileSource& source = Filesystem());

  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Shard by shard, each in the order of its bytes: the order a sequential read takes.
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  const CheckpointTensor* Find(const std::string& name) const;
  uint64_t tensor_bytes() const { return tensor_bytes_; }
  // The index's real path, when the checkpoint is sharded ("" otherwise).
  const std::string& index_path() const { return index_path_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<CheckpointTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;  // name to position in tensors_
  uint64_t tensor_bytes_ = 0;
  std::string index_path_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SAFETENSORS_CHECKPOINT_SET_H_
