// SPDX-License-Identifier: Apache-2.0
#include "rpc/request_validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

bool AllNameCharacters(absl::string_view text) {
  for (char c : text) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != ':' &&
        c != '/' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::Status CheckIdentifier(absl::string_view what, absl::string_view text, size_t max_length,
                             bool may_be_empty) {
  if (text.empty()) {
    if (may_be_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat("%s is empty", what));
  }
  if (text.size() > max_length) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is %d characters long; the most is %d", what, text.size(), max_length));
  }
  if (!AllNameCharacters(text)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s may hold only letters, digits and _ . : / - characters", what));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSessionId(absl::string_view session_id) {
  if (session_id.empty()) return absl::InvalidArgumentError("session_id is empty");
  if (session_id.size() != 18 || session_id.substr(0, 2) != "s-" ||
      !std::all_of(session_id.begin() + 2, session_id.end(),
                   [](char c) { return absl::ascii_isxdigit(static_cast<unsigned char>(c)); })) {
    return absl::InvalidArgumentError(
        "session_id is malformed: expected 's-' and 16 hex digits, as OpenSession returns");
  }
  return absl::OkStatus();
}

absl::Status ValidateBufferName(absl::string_view name) {
  return CheckIdentifier("buffer name", name, kMaxNameLength, false);
}

absl::Status ValidateJobId(absl::string_view job_id) {
  return CheckIdentifier("job_id", job_id, kMaxNameLength, true);
}

absl::Status ValidateTag(absl::string_view tag) { return CheckIdentifier("tag", tag, 64, true); }

namespace {

absl::Status CheckEventName(absl::string_view what, absl::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be 1 to 64 characters long, not %d", what, name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_islower(static_cast<unsigned char>(c)) &&
        !absl::ascii_isdigit(static_cast<unsigned char>(c)) && c != '_' && c != '.') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s '%s' may hold only lower-case letters, digits, '_' and '.'", what, name));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateEventKind(absl::string_view kind) { return CheckEventName("event kind", kind); }

absl::Status ValidateEventMessage(absl::string_view message) {
  if (message.size() > kMaxEventMessageBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "event message is %d bytes long; the most is %d", message.size(), kMaxEventMessageBytes));
  }
  return absl::OkStatus();
}

absl::Status ValidateEventNumber(absl::string_view name, double value) {
  absl::Status valid = CheckEventName("event number name", name);
  if (!valid.ok()) return valid;
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("event number '%s' is %f; numbers must be finite", name, value));
  }
  return absl::OkStatus();
}

absl::Status ValidateBufferSize(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes is 0: a buffer needs at least one byte");
  if (bytes > kMaxBufferBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bytes %d is larger than any buffer can be (16 TiB)", bytes));
  }
  return absl::OkStatus();
}

absl::Status ValidateAlignment(uint64_t alignment) {
  if (alignment == 0) return absl::OkStatus();
  if ((alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "alignment %d is not a power of two up to 2 MiB (0 means 4096)", alignment));
  }
  return absl::OkStatus();
}

absl::Status ValidateRank(uint32_t rank, uint32_t world_size) {
  uint32_t world = world_size == 0 ? 1 : world_size;
  if (world > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world_size %d is above the limit of %d", world_size, kMaxWorldSize));
  }
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not below world_size %d", rank, world));
  }
  return absl::OkStatus();
}

absl::Status ValidateBufferId(uint64_t buffer_id) {
  if (buffer_id == 0) return absl::InvalidArgumentError("buffer_id is 0, which no buffer has");
  return absl::OkStatus();
}

absl::Status ValidateRange(uint64_t offset, uint64_t bytes, uint64_t buffer_bytes) {
  if (offset > buffer_bytes || bytes > buffer_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "range [%d, %d + %d) runs past the end of a %d-byte buffer", offset, offset, bytes,
        buffer_bytes));
  }
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
