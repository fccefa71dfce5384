// SPDX-License-Identifier: Apache-2.0
// Checks on every field a client sends, before anything acts on it. Each failure is
// INVALID_ARGUMENT with a message that names the field and what it accepts.
#ifndef TRAINSTREAM_DAEMON_RPC_REQUEST_VALIDATION_H_
#define TRAINSTREAM_DAEMON_RPC_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace trainstream::daemon {

inline constexpr size_t kMaxNameLength = 128;
inline constexpr uint64_t kMaxBufferBytes = uint64_t{1} << 44;  // 16 TiB
inline constexpr uint64_t kMaxAlignment = uint64_t{2} << 20;
inline constexpr uint32_t kMaxWorldSize = 65536;

absl::Status ValidateSessionId(absl::string_view session_id);
// Buffer names: 1..128 of [A-Za-z0-9_.:/-].
absl::Status ValidateBufferName(absl::string_view name);
// Job ids: like names, but may be empty (the job "default").
absl::Status ValidateJobId(absl::string_view job_id);
// Tags: up to 64 of the name characters, may be empty.
absl::Status ValidateTag(absl::string_view tag);
absl::Status ValidateBufferSize(uint64_t bytes);
absl::Status ValidateAlignment(uint64_t alignment);
absl::Status ValidateRank(uint32_t rank, uint32_t world_size);
absl::Status ValidateBufferId(uint64_t buffer_id);
// A client-reported event: kind and number names 1..64 of [a-z0-9_.], message up to 1024
// bytes, up to 16 finite numbers.
inline constexpr size_t kMaxEventMessageBytes = 1024;
inline constexpr size_t kMaxEventNumbers = 16;
absl::Status ValidateEventKind(absl::string_view kind);
absl::Status ValidateEventMessage(absl::string_view message);
absl::Status ValidateEventNumber(absl::string_view name, double value);
// [offset, offset + bytes) must lie inside a buffer of `buffer_bytes`, without overflow.
absl::Status ValidateRange(uint64_t offset, uint64_t bytes, uint64_t buffer_bytes);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_REQUEST_VALIDATION_H_
