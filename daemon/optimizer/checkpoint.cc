// SPDX-License-Identifier: Apache-2.0
#include "optimizer/checkpoint.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "ipc/checkpoint_temporaries.h"
#include "optimizer/checkpoint_file_writer.h"
#include "ipc/unique_fd.h"
#include "safetensors/safetensors_file.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

constexpr char kFormat[] = "trainstream-optimizer-v1";

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

// The calling thread yields the CPU and the disk to everything else (a nice of 19, the lowest
// best-effort I/O priority). Preferences only: a failure changes nothing but the timing.
void LowerThisThreadsPriority() {
  const auto tid = static_cast<id_t>(::gettid());
  ::setpriority(PRIO_PROCESS, tid, 19);
  constexpr int kWhoProcess = 1, kClassBestEffort = 2, kClassShift = 13, kLowest = 7;
  ::syscall(SYS_ioprio_set, kWhoProcess, static_cast<int>(tid),
            (kClassBestEffort << kClassShift) | kLowest);
}

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

}  // namespace

namespace {

// Runs `write` on a thread of its own at background priority: a save of gigabytes copies them
// into its staging buffer on one core, and the other jobs' steps, on the daemon's other threads,
// come first (the thread is new each time, since a thread cannot raise its priority back).
absl::StatusOr<uint64_t> InBackground(const std::function<absl::StatusOr<uint64_t>()>& write) {
  absl::StatusOr<uint64_t> written = absl::InternalError("the checkpoint writer did not run");
  std::thread writer([&] {
    LowerThisThreadsPriority();
    written = write();
  });
  writer.join();
  return written;
}

// The checkpoint's bytes, from the current offset of `fd`, then fsync. Returns the bytes.
absl::StatusOr<uint64_t> WriteContents(int fd, const std::string& name,
                                       const CheckpointContents& contents) {
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
  const uint64_t header_size = header.size();
  uint8_t size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(header_size >> (8 * i));
  CheckpointFileWriter out(fd, name);
  RETURN_IF_ERROR(out.Write(size_bytes, 8));
  RETURN_IF_ERROR(out.Write(header.data(), header.size()));
  for (const CheckpointArray& a : contents.arrays) {
    RETURN_IF_ERROR(out.Write(a.data, a.numel * kernels::ElementSize(a.type)));
  }
  RETURN_IF_ERROR(out.Finish());
  return 8 + header_size + offset;
}

absl::StatusOr<uint64_t> WriteCheckpointHere(const std::string& path,
                                             const CheckpointContents& contents) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", path, "' must be absolute"));
  }
  ipc::RemoveAbandonedTemporaries(path);
  const std::string temporary = ipc::CheckpointTemporaryName(path);
  ipc::UniqueFd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("creating ", temporary));
  absl::StatusOr<uint64_t> written = WriteContents(fd.get(), temporary, contents);
  fd.Reset();
  if (!written.ok()) {
    ::unlink(temporary.c_str());
    return written;
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const absl::Status failed =
        ErrnoStatus(errno, absl::StrCat("renaming the checkpoint to ", path));
    ::unlink(temporary.c_str());
    return failed;
  }
  const std::string directory = std::filesystem::path(path).parent_path().string();
  ipc::UniqueFd dir(::open(directory.empty() ? "/" : directory.c_str(),
                           O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.valid()) ::fsync(dir.get());
  return written;
}

}  // namespace

absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& path,
                                         const CheckpointContents& contents) {
  return InBackground([&] { return WriteCheckpointHere(path, contents); });
}

absl::StatusOr<uint64_t> WriteCheckpointToFile(int fd, const std::string& name,
                                               const CheckpointContents& contents) {
  return InBackground([&]() -> absl::StatusOr<uint64_t> {
    // Whatever the file held before goes; its offset is shared with the client that opened it,
    // which waits for this request.
    if (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
      return ErrnoStatus(errno, absl::StrCat("truncating ", name));
    }
    return WriteContents(fd, name, contents);
  });
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path,
                                                  const CheckpointContents& expected,
                                                  const FileSource& source) {
  // Its header lists every parameter of the job: more than a model checkpoint's.
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path, uint64_t{256} << 20, source);
  if (!file.ok()) return file.status();
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", why));
  };
  const auto blob = file->metadata().find("trainstream");
  if (blob == file->metadata().end()) {
    return bad("no trainstream optimizer metadata (was it written by SaveCheckpoint?)");
  }
  google::protobuf::Struct meta;
  if (!google::protobuf::util::JsonStringToMessage(blob->second, &meta).ok()) {
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
  // Counts in the metadata are JSON numbers (doubles): each must be a whole number a uint64
  // holds exactly, or the file is refused (a -1 once loaded as step 18446744073709551615).
  auto count = [&](const google::protobuf::Value* v, const char* what,
                   uint64_t* out_value) -> absl::Status {
    if (v == nullptr) {
      *out_value = 0;
      return absl::OkStatus();
    }
    const double x = v->number_value();
    if (v->kind_case() != google::protobuf::Value::kNumberValue || !(x >= 0) ||
        x > 9007199254740992.0 || x != std::floor(x)) {
      return bad(absl::StrCat(what, " is not a count (", v->DebugString(), ")"));
    }
    *out_value = static_cast<uint64_t>(x);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(count(Field(meta, "iteration"), "the iteration", &out.iteration));
  for (int i = 0; i < params->list_value().values_size(); ++i) {
    const google::protobuf::Struct& p = params->list_value().values(i).struct_value();
    const CheckpointParameter& want = expected.params[i];
    const google::protobuf::Value* name = Field(p, "name");
    const google::protobuf::Value* numel = Field(p, "numel");
    uint64_t elements = 0, step = 0;
    RETURN_IF_ERROR(count(Field(p, "numel"), "a parameter's element count", &elements));
    RETURN_IF_ERROR(count(Field(p, "step"), "a parameter's step", &step));
    if (!name || !numel || name->string_value() != want.desc.name ||
        elements != want.desc.numel) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: parameter %d is '%s' with %d elements; the job has '%s' with %d", path,
          i, name ? name->string_value() : "?", elements, want.desc.name, want.desc.numel));
    }
    out.params.push_back({want.desc, step});
  }
  for (const CheckpointArray& a : expected.arrays) {
    const SafetensorsTensor* t = file->Find(a.name);
    if (t == nullptr) return bad(absl::StrCat("tensor '", a.name, "' is missing"));
    const uint64_t bytes = a.numel * kernels::ElementSize(a.type);
    if (t->dtype != SafetensorsDtype(a.type)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: tensor '%s' is %s; expected %s", path, a.name, t->dtype,
          SafetensorsDtype(a.type)));
    }
    if (t->bytes != bytes) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %s: tensor '%s' holds %d bytes; expected %d", path, a.name, t->bytes,
          bytes));
    }
  }
  // Everything checked: only now overwrite the live state.
  for (const CheckpointArray& a : expected.arrays) {
    const SafetensorsTensor* t = file->Find(a.name);
    RETURN_IF_ERROR(file->Read(t->offset, a.data, t->bytes));
  }
  return out;
}

}  // namespace trainstream::daemon
