// SPDX-License-Identifier: Apache-2.0
#include "optimizer/checkpoint.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "ipc/unique_fd.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

constexpr char kFormat[] = "trainstream-optimizer-v1";
constexpr uint64_t kMaxHeaderBytes = uint64_t{256} << 20;

const char* SafetensorsDtype(kernels::ScalarType type) {
  switch (type) {
    case kernels::ScalarType::kFloat32: return "F32";
    case kernels::ScalarType::kBFloat16: return "BF16";
    case kernels::ScalarType::kFloat16: return "F16";
  }
  return "?";
}

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string MetadataJson(const CheckpointContents& c) {
  const OptimizerSettings& s = c.settings;
  std::string groups;
  for (const GroupHyperParameters& g : s.groups) {
    absl::StrAppend(&groups, groups.empty() ? "" : ",",
                    absl::StrFormat("{\"lr\":%.17g,\"beta1\":%.17g,\"beta2\":%.17g,"
                                    "\"eps\":%.17g,\"weight_decay\":%.17g}",
                                    g.lr, g.beta1, g.beta2, g.eps, g.weight_decay));
  }
  std::string params;
  for (const CheckpointParameter& p : c.params) {
    absl::StrAppend(&params, params.empty() ? "" : ",",
                    absl::StrFormat("{\"name\":%s,\"numel\":%d,\"param_dtype\":\"%s\","
                                    "\"grad_dtype\":\"%s\",\"group\":%d,\"step\":%d}",
                                    JsonString(p.desc.name), p.desc.numel,
                                    kernels::ScalarTypeName(p.desc.param_type),
                                    kernels::ScalarTypeName(p.desc.grad_type), p.desc.group,
                                    p.step));
  }
  return absl::StrFormat(
      "{\"format\":\"%s\",\"job_id\":%s,\"iteration\":%d,\"kind\":\"%s\","
      "\"moment_dtype\":\"%s\",\"accumulation_steps\":%d,\"max_grad_norm\":%.17g,"
      "\"groups\":[%s],\"params\":[%s]}",
      kFormat, JsonString(c.job_id), c.iteration, s.decoupled_weight_decay ? "adamw" : "adam",
      kernels::ScalarTypeName(s.moment_type), s.accumulation_steps, s.max_grad_norm, groups,
      params);
}

absl::Status WriteAll(int fd, const void* data, uint64_t bytes, const std::string& path) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, std::min<uint64_t>(bytes, uint64_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing checkpoint ", path));
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, uint64_t bytes, uint64_t offset,
                     const std::string& path) {
  uint8_t* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, uint64_t{1} << 30),
                        static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading checkpoint ", path));
    }
    if (n == 0) return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated"));
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

}  // namespace

absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& path,
                                         const CheckpointContents& contents) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", path, "' must be absolute"));
  }
  std::string header = absl::StrCat("{\"__metadata__\":{\"format\":\"", kFormat,
                                    "\",\"trainstream\":", JsonString(MetadataJson(contents)),
                                    "}");
  uint64_t offset = 0;
  for (const CheckpointArray& a : contents.arrays) {
    const uint64_t bytes = a.numel * kernels::ElementSize(a.type);
    absl::StrAppend(&header, ",", JsonString(a.name),
                    absl::StrFormat(":{\"dtype\":\"%s\",\"shape\":[%d],\"data_offsets\":[%d,%d]}",
                                    SafetensorsDtype(a.type), a.numel, offset, offset + bytes));
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned

  // Unique beside concurrent writers of the same path; the pid alone would do within one daemon.
  uint64_t random = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  if (::getrandom(&random, sizeof(random), GRND_NONBLOCK) != sizeof(random)) random ^= ::getpid();
  const std::string temporary = absl::StrFormat("%s.tmp-%d-%016x", path, ::getpid(), random);
  ipc::UniqueFd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("creating ", temporary));
  auto fail = [&](absl::Status status) {
    ::unlink(temporary.c_str());
    return status;
  };
  const uint64_t header_size = header.size();
  uint8_t size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(header_size >> (8 * i));
  if (absl::Status s = WriteAll(fd.get(), size_bytes, 8, temporary); !s.ok()) return fail(s);
  if (absl::Status s = WriteAll(fd.get(), header.data(), header.size(), temporary); !s.ok()) {
    return fail(s);
  }
  for (const CheckpointArray& a : contents.arrays) {
    absl::Status s = WriteAll(fd.get(), a.data, a.numel * kernels::ElementSize(a.type), temporary);
    if (!s.ok()) return fail(s);
  }
  if (::fsync(fd.get()) != 0) return fail(ErrnoStatus(errno, absl::StrCat("fsync ", temporary)));
  fd.Reset();
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    return fail(ErrnoStatus(errno, absl::StrCat("renaming the checkpoint to ", path)));
  }
  const std::string directory = std::filesystem::path(path).parent_path().string();
  ipc::UniqueFd dir(::open(directory.empty() ? "/" : directory.c_str(),
                           O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.valid()) ::fsync(dir.get());
  return 8 + header_size + offset;
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path,
                                                  const CheckpointContents& expected) {
  ipc::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("opening checkpoint ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", why));
  };
  if (file_bytes < 8) return bad("too short to be a safetensors file");
  uint8_t size_bytes[8];
  RETURN_IF_ERROR(ReadAll(fd.get(), size_bytes, 8, 0, path));
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(size_bytes[i]) << (8 * i);
  if (header_size > kMaxHeaderBytes || header_size > file_bytes - 8) {
    return bad("header size runs past the end of the file (truncated or not a checkpoint)");
  }
  std::string header(header_size, '\0');
  RETURN_IF_ERROR(ReadAll(fd.get(), header.data(), header_size, 8, path));
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(header, &root).ok()) {
    return bad("header is not valid JSON");
  }
  const google::protobuf::Value* metadata = Field(root, "__metadata__");
  const google::protobuf::Value* blob =
      metadata ? Field(metadata->struct_value(), "trainstream") : nullptr;
  if (blob == nullptr || blob->kind_case() != google::protobuf::Value::kStringValue) {
    return bad("no trainstream optimizer metadata (was it written by SaveCheckpoint?)");
  }
  google::protobuf::Struct meta;
  if (!google::protobuf::util::JsonStringToMessage(blob->string_value(), &meta).ok()) {
    return bad("optimizer metadata is not valid JSON");
  }
  const google::protobuf::Value* format = Field(meta, "format");
  if (!format || format->string_value() != kFormat) return bad("unknown optimizer format");
  const google::protobuf::Value* moment = Field(meta, "moment_dtype");
  if (!moment || moment->string_value() != kernels::ScalarTypeName(expected.settings.moment_type)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %s holds %s moments; this optimizer keeps %s", path,
        moment ? moment->string_value() : "unknown",
        kernels::ScalarTypeName(expected.settings.moment_type)));
  }
  const google::protobuf::Value* params = Field(meta, "params");
  if (!params || params->list_value().values_size() != static_cast<int>(expected.params.size())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %s holds %d parameters; the job has %d", path,
        params ? params->list_value().values_size() : 0, expected.params.size()));
  }
  CheckpointContents out;
  out.job_id = expected.job_id;
  out.settings = expected.settings;
  const google::protobuf::Value* iteration = Field(meta, "iteration");
  out.iteration = iteration ? static_cast<uint64_t>(iteration->number_value()) : 0;
  for (int i = 0; i < params->list_value().values_size(); ++i) {
    const google::protobuf::Struct& p = params->list_value().values(i).struct_value();
    const CheckpointParameter& want = expected.params[i];
    const google::protobuf::Value* name = Field(p, "name");
    const google::protobuf::Value* numel = Field(p, "numel");
    const google::protobuf::Value* step = Field(p, "step");
    if (!name || !numel || name->string_value() != want.desc.name ||
        static_cast<uint64_t>(numel->number_value()) != want.desc.numel) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: parameter %d is '%s' with %d elements; the job has '%s' with %d", path,
          i, name ? name->string_value() : "?",
          numel ? static_cast<uint64_t>(numel->number_value()) : 0, want.desc.name,
          want.desc.numel));
    }
    out.params.push_back({want.desc, step ? static_cast<uint64_t>(step->number_value()) : 0});
  }
  const uint64_t data_start = 8 + header_size;
  for (const CheckpointArray& a : expected.arrays) {
    const google::protobuf::Value* entry = Field(root, a.name);
    if (!entry) return bad(absl::StrCat("tensor '", a.name, "' is missing"));
    const google::protobuf::Struct& e = entry->struct_value();
    const google::protobuf::Value* dtype = Field(e, "dtype");
    const google::protobuf::Value* offsets = Field(e, "data_offsets");
    const uint64_t bytes = a.numel * kernels::ElementSize(a.type);
    if (!dtype || dtype->string_value() != SafetensorsDtype(a.type)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: tensor '%s' is %s; expected %s", path, a.name,
          dtype ? dtype->string_value() : "untyped", SafetensorsDtype(a.type)));
    }
    if (!offsets || offsets->list_value().values_size() != 2) {
      return bad(absl::StrCat("tensor '", a.name, "' has no data_offsets"));
    }
    const uint64_t begin = static_cast<uint64_t>(offsets->list_value().values(0).number_value());
    const uint64_t end = static_cast<uint64_t>(offsets->list_value().values(1).number_value());
    if (end < begin || end - begin != bytes) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: tensor '%s' holds %d bytes; expected %d", path, a.name, end - begin,
          bytes));
    }
    if (data_start + end > file_bytes) {
      return absl::DataLossError(
          absl::StrFormat("checkpoint %s is truncated inside tensor '%s'", path, a.name));
    }
  }
  // Everything checked: only now overwrite the live state.
  for (const CheckpointArray& a : expected.arrays) {
    const google::protobuf::Struct& e = Field(root, a.name)->struct_value();
    const uint64_t begin =
        static_cast<uint64_t>(Field(e, "data_offsets")->list_value().values(0).number_value());
    RETURN_IF_ERROR(ReadAll(fd.get(), a.data, a.numel * kernels::ElementSize(a.type),
                            data_start + begin, path));
  }
  return out;
}

}  // namespace trainstream::daemon
