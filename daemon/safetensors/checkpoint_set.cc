// SPDX-License-Identifier: Apache-2.0
#include "safetensors/checkpoint_set.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The shard file of each tensor, from an index file.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path,
                                                            const FileSource& source) {
  uint64_t bytes = 0;
  absl::StatusOr<ipc::UniqueFd> fd = source.OpenForReading(path, &bytes);
  if (!fd.ok()) return fd.status();
  if (bytes > kMaxIndexBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too large to be a checkpoint index"));
  }
  std::string text(bytes, '\0');
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd->get(), text.data() + done, bytes - done,
                              static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::DataLossError(absl::StrCat("reading ", path, " failed"));
    done += static_cast<uint64_t>(n);
  }
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(text, &root).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  const auto map = root.fields().find("weight_map");
  if (map == root.fields().end() ||
      map->second.kind_case() != google::protobuf::Value::kStructValue) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"weight_map\" object"));
  }
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : map->second.struct_value().fields()) {
    if (file.kind_case() != google::protobuf::Value::kStringValue) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": the shard of '", name, "' is not a name"));
    }
    const std::string& shard = file.string_value();
    // Shards sit beside the index: a name that leaves the folder is refused.
    if (shard.empty() || absl::StrContains(shard, "/") || shard == "." || shard == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": shard '", shard, "' of '", name, "' is not a file name"));
    }
    shard_of[name] = shard;
  }
  return shard_of;
}

}  // namespace

absl::StatusOr<CheckpointSet> CheckpointSet::Open(const std::string& path,
                                                  const FileSource& source) {
  std::string target = path;
  if (source.IsDirectory(path)) {
    const std::string single = path + "/model.safetensors";
    const std::string index = path + "/model.safetensors.index.json";
    if (source.Exists(index)) {
      target = index;
    } else if (source.Exists(single)) {
      target = single;
    } else {
      return absl::NotFoundError(absl::StrFormat(
          "%s holds neither model.safetensors nor model.safetensors.index.json", path));
    }
  }
  CheckpointSet set;
  // What a file is and where its shards are, by the name it was given: a Hugging Face cache
  // links each file of a snapshot to a blob named by its hash, in another folder.
  const bool is_index = absl::EndsWith(target, ".json");
  const std::string folder = Directory(target);
  // Every file is opened by its real path, which is the one the files() list reports (and
  // the one a caller's rights are checked on).
  absl::StatusOr<std::string> real = source.RealPath(target);
  if (!real.ok()) return real.status();
  target = *real;
  set.index_path_ = is_index ? target : "";
  if (!is_index) {
    absl::StatusOr<SafetensorsFile> file =
        SafetensorsFile::Open(target, SafetensorsFile::kDefaultMaxHeaderBytes, source);
    if (!file.ok()) return file.status();
    set.files_.push_back(std::make_unique<SafetensorsFile>(*std::move(file)));
  } else {
    absl::StatusOr<std::map<std::string, std::string>> shard_of = ReadIndex(target, source);
    if (!shard_of.ok()) return shard_of.status();
    std::set<std::string> shards;
    for (const auto& [name, shard] : *shard_of) shards.insert(shard);
    std::map<std::string, const SafetensorsFile*> file_of_shard;
    for (const std::string& shard : shards) {
      absl::StatusOr<std::string> shard_path = source.RealPath(folder + "/" + shard);
      if (!shard_path.ok()) return shard_path.status();
      absl::StatusOr<SafetensorsFile> file =
          SafetensorsFile::Open(*shard_path, SafetensorsFile::kDefaultMaxHeaderBytes, source);
      if (!file.ok()) return file.status();
      for (const SafetensorsTensor& t : file->tensors()) {
        const auto listed = shard_of->find(t.name);
        if (listed == shard_of->end() || listed->second != shard) {
          return absl::DataLossError(absl::StrFormat(
              "%s holds tensor '%s', which the index %s", file->path(), t.name,
              listed == shard_of->end() ? "does not list"
                                        : absl::StrCat("places in ", listed->second)));
        }
      }
      set.files_.push_back(std::make_unique<SafetensorsFile>(*std::move(file)));
      file_of_shard[shard] = set.files_.back().get();
    }
    for (const auto& [name, shard] : *shard_of) {
      const SafetensorsFile* file = file_of_shard.at(shard);
      if (file->Find(name) == nullptr) {
        return absl::DataLossError(absl::StrFormat(
            "the index %s places tensor '%s' in %s, which does not hold it", target, name,
            file->path()));
      }
    }
  }
  for (const auto& file : set.files_) {
    for (const SafetensorsTensor& t : file->tensors()) {
      if (!set.index_.emplace(t.name, set.tensors_.size()).second) {
        return absl::DataLossError(
            absl::StrFormat("tensor '%s' is in more than one file (%s)", t.name, file->path()));
      }
      set.tensors_.push_back({file.get(), &t});
      set.tensor_bytes_ += t.bytes;
    }
  }
  return set;
}

const CheckpointTensor* CheckpointSet::Find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace trainstream::daemon
