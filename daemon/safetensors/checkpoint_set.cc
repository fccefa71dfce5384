// SPDX-License-Identifier: Apache-2.0
#include "safetensors/checkpoint_set.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The shard file of each tensor, from an index file.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open checkpoint index ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().size() > kMaxIndexBytes) {
    return absl::DataLossError(absl::StrCat(path, ": too large to be a checkpoint index"));
  }
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(text.str(), &root).ok()) {
    return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  }
  const auto map = root.fields().find("weight_map");
  if (map == root.fields().end() ||
      map->second.kind_case() != google::protobuf::Value::kStructValue) {
    return absl::DataLossError(absl::StrCat(path, ": no \"weight_map\" object"));
  }
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : map->second.struct_value().fields()) {
    if (file.kind_case() != google::protobuf::Value::kStringValue) {
      return absl::DataLossError(absl::StrCat(path, ": the shard of '", name, "' is not a name"));
    }
    const std::string& shard = file.string_value();
    // Shards sit beside the index: a name that leaves the folder is refused.
    if (shard.empty() || absl::StrContains(shard, "/") || shard == "." || shard == "..") {
      return absl::DataLossError(
          absl::StrCat(path, ": shard '", shard, "' of '", name, "' is not a file name"));
    }
    shard_of[name] = shard;
  }
  return shard_of;
}

}  // namespace

absl::StatusOr<CheckpointSet> CheckpointSet::Open(const std::string& path) {
  std::string target = path;
  if (IsDirectory(path)) {
    const std::string single = path + "/model.safetensors";
    const std::string index = path + "/model.safetensors.index.json";
    if (Exists(index)) {
      target = index;
    } else if (Exists(single)) {
      target = single;
    } else {
      return absl::NotFoundError(absl::StrFormat(
          "%s holds neither model.safetensors nor model.safetensors.index.json", path));
    }
  }
  CheckpointSet set;
  if (!absl::EndsWith(target, ".json")) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(target);
    if (!file.ok()) return file.status();
    set.files_.push_back(std::make_unique<SafetensorsFile>(*std::move(file)));
  } else {
    absl::StatusOr<std::map<std::string, std::string>> shard_of = ReadIndex(target);
    if (!shard_of.ok()) return shard_of.status();
    std::set<std::string> shards;
    for (const auto& [name, shard] : *shard_of) shards.insert(shard);
    const std::string folder = Directory(target);
    for (const std::string& shard : shards) {
      absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(folder + "/" + shard);
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
    }
    for (const auto& [name, shard] : *shard_of) {
      const auto file = std::find_if(set.files_.begin(), set.files_.end(), [&](const auto& f) {
        return absl::EndsWith(f->path(), "/" + shard);
      });
      if ((*file)->Find(name) == nullptr) {
        return absl::DataLossError(absl::StrFormat(
            "the index %s places tensor '%s' in %s, which does not hold it", target, name,
            (*file)->path()));
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
