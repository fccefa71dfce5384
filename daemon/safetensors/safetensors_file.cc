// SPDX-License-Identifier: Apache-2.0
#include "safetensors/safetensors_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace trainstream::daemon {
namespace {

// Integers in the header are JSON numbers, read as doubles: exact up to 2^53.
constexpr double kMaxExactInteger = 9007199254740992.0;

// Arrays and objects a header may nest: a table of tensors needs three, metadata none more.
constexpr int kMaxHeaderDepth = 16;

// The deepest nesting of arrays and objects in JSON text (strings and their escapes skipped):
// one pass, nothing allocated, so that refusing a hostile header costs what reading it did.
int NestingDepth(const std::string& json) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

bool AsCount(const google::protobuf::Value& v, uint64_t* out) {
  if (v.kind_case() != google::protobuf::Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!(d >= 0 && d <= kMaxExactInteger) || std::floor(d) != d) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

}  // namespace

absl::StatusOr<uint32_t> SafetensorsElementSize(std::string_view dtype) {
  static const std::pair<const char*, uint32_t> kSizes[] = {
      {"F64", 8}, {"I64", 8}, {"U64", 8}, {"F32", 4},     {"I32", 4},     {"U32", 4},
      {"F16", 2}, {"BF16", 2}, {"I16", 2}, {"U16", 2},    {"I8", 1},      {"U8", 1},
      {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, size] : kSizes) {
    if (dtype == name) return size;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", std::string(dtype), "'"));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path,
                                                      uint64_t max_header_bytes,
                                                      const FileSource& source) {
  SafetensorsFile file;
  file.path_ = path;
  absl::StatusOr<ipc::UniqueFd> fd = source.OpenForReading(path, &file.file_bytes_);
  if (!fd.ok()) return fd.status();
  file.fd_ = *std::move(fd);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s", path, why));
  };
  auto truncated = [&](const std::string& why) {
    return absl::DataLossError(absl::StrFormat("%s: %s", path, why));
  };
  if (file.file_bytes_ < 8) return bad("too short to be a safetensors file (8-byte header size)");
  uint8_t size_bytes[8];
  if (absl::Status s = file.Read(0, size_bytes, 8); !s.ok()) return s;
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<uint64_t>(size_bytes[i]) << (8 * i);
  if (header_bytes > max_header_bytes) {
    return bad(absl::StrFormat("the header claims %d bytes, more than a header may hold",
                               header_bytes));
  }
  if (header_bytes > file.file_bytes_ - 8) {
    return truncated(absl::StrFormat(
        "the header claims %d bytes; the file has %d after the size (truncated, or not a "
        "safetensors file)", header_bytes, file.file_bytes_ - 8));
  }
  std::string header(header_bytes, '\0');
  if (absl::Status s = file.Read(8, header.data(), header_bytes); !s.ok()) return s;
  // A header is a table of tensors three levels deep; JSON nested far deeper (30,000 levels
  // in 60 KB once took 21 s of the parser's CPU) is refused before it is parsed.
  if (const int depth = NestingDepth(header); depth > kMaxHeaderDepth) {
    return bad(absl::StrFormat("the header nests %d levels deep, more than the %d a safetensors "
                               "header may", depth, kMaxHeaderDepth));
  }
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(header, &root).ok()) {
    return bad("the header is not valid JSON (not a safetensors file)");
  }
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file.file_bytes_ - data_start;
  for (const auto& field : root.fields()) {
    // Named, not structured bindings: the lambda below captures the name (clang 14 can't).
    const std::string& name = field.first;
    const google::protobuf::Value& value = field.second;
    if (name == "__metadata__") {
      if (value.kind_case() != google::protobuf::Value::kStructValue) {
        return bad("__metadata__ is not an object");
      }
      for (const auto& [key, item] : value.struct_value().fields()) {
        if (item.kind_case() != google::protobuf::Value::kStringValue) {
          return bad(absl::StrCat("__metadata__ value '", key, "' is not a string"));
        }
        file.metadata_[key] = item.string_value();
      }
      continue;
    }
    auto bad_tensor = [&](const std::string& why) {
      return bad(absl::StrCat("tensor '", name, "': ", why));
    };
    if (value.kind_case() != google::protobuf::Value::kStructValue) {
      return bad_tensor("its entry is not an object");
    }
    const auto& fields = value.struct_value().fields();
    const auto dtype = fields.find("dtype");
    const auto shape = fields.find("shape");
    const auto offsets = fields.find("data_offsets");
    if (dtype == fields.end() || dtype->second.kind_case() !=
                                     google::protobuf::Value::kStringValue) {
      return bad_tensor("no dtype");
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = dtype->second.string_value();
    absl::StatusOr<uint32_t> size = SafetensorsElementSize(t.dtype);
    if (!size.ok()) return bad_tensor(std::string(size.status().message()));
    t.element_size = *size;
    if (shape == fields.end() || shape->second.kind_case() !=
                                     google::protobuf::Value::kListValue) {
      return bad_tensor("no shape");
    }
    t.numel = 1;
    for (const auto& dim : shape->second.list_value().values()) {
      uint64_t d = 0;
      if (!AsCount(dim, &d)) return bad_tensor("a dimension is not a non-negative integer");
      if (d != 0 && t.numel > (uint64_t{1} << 62) / d) return bad_tensor("its shape overflows");
      t.shape.push_back(d);
      t.numel *= d;
    }
    uint64_t begin = 0, end = 0;
    if (offsets == fields.end() ||
        offsets->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.list_value().values_size() != 2 ||
        !AsCount(offsets->second.list_value().values(0), &begin) ||
        !AsCount(offsets->second.list_value().values(1), &end) || end < begin) {
      return bad_tensor("data_offsets is not a pair [begin, end] with begin <= end");
    }
    t.bytes = end - begin;
    if (t.bytes / t.element_size != t.numel || t.bytes % t.element_size != 0) {
      return bad_tensor(absl::StrFormat("%d bytes do not hold %d %s values", t.bytes, t.numel,
                                        t.dtype));
    }
    if (end > data_bytes) {
      return truncated(absl::StrCat("tensor '", name, "': ", absl::StrFormat(
          "its bytes end at %d, past the %d bytes of data the file holds (truncated)", end,
          data_bytes)));
    }
    t.offset = data_start + begin;
    file.tensors_.push_back(std::move(t));
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.offset < b.offset || (a.offset == b.offset && a.name < b.name);
            });
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.index_[file.tensors_[i].name] = i;
  // Sorted by start: a tensor overlaps an earlier one when it starts before the furthest end
  // seen so far (empty tensors hold no bytes and overlap nothing).
  const SafetensorsTensor* furthest = nullptr;
  for (const SafetensorsTensor& t : file.tensors_) {
    if (t.bytes == 0) continue;
    if (furthest != nullptr && t.offset < furthest->offset + furthest->bytes) {
      return bad(absl::StrCat("tensors '", furthest->name, "' and '", t.name, "' overlap"));
    }
    if (furthest == nullptr || t.offset + t.bytes > furthest->offset + furthest->bytes) {
      furthest = &t;
    }
  }
  return file;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::Read(uint64_t offset, void* out, uint64_t bytes) const {
  auto* p = static_cast<uint8_t*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_.get(), p, std::min<uint64_t>(bytes, uint64_t{1} << 30),
                              static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::DataLossError(
          absl::StrFormat("reading %s at %d: %s", path_, offset, std::strerror(errno)));
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrFormat("%s ends at %d, before the %d bytes expected there (truncated)", path_,
                          offset, bytes));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

std::string SafetensorsFile::Identity() const {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return absl::StrCat("unknown:", path_);
  return absl::StrFormat("%d:%d %d %d.%09d", st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec,
                         st.st_mtim.tv_nsec);
}

}  // namespace trainstream::daemon
