// SPDX-License-Identifier: Apache-2.0
// Shared frozen bases: one host copy of a checkpoint's tensors (bf16 or quantized) that every
// process of a user maps read-only. The first process to ask has the daemon read the
// checkpoint; the others attach to the same sealed segments, while it loads or once it has.
#ifndef TRAINSTREAM_DAEMON_BASES_BASE_STORE_H_
#define TRAINSTREAM_DAEMON_BASES_BASE_STORE_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "arena/arena.h"
#include "cpu/quantize.h"
#include "events/event_log.h"
#include "safetensors/file_source.h"
#include "safetensors/tensor_reader.h"
#include "sessions/session.h"

namespace trainstream::daemon {

struct BaseLoadRequest {
  std::string path;            // absolute: a .safetensors file, an index, or their folder
  std::string format = "bf16"; // bf16, int8, nf4, fp8 or nvfp4
  int block = 0;               // 0: the format's default
  // Tensors to quantize, by name; empty: every 2-D floating-point tensor but the embeddings
  // and the output head (names holding "embed" or "lm_head"). A quantized base keeps the
  // others as the file has them; a bf16 base converts every float to bf16.
  std::vector<std::string> quantize;
  std::string name;  // shown by tsctl; default: the checkpoint's folder or file name
  // Only size it (state kPlanned, nothing loaded or attached): what a client weighs formats by.
  bool plan_only = false;
};

struct BaseTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::string source_dtype;
  StoredAs stored = StoredAs::kAsIs;
  kernels::QuantFormat format = kernels::QuantFormat::kInt8;  // when quantized
  int block = 0;
  float tensor_scale = 1.0f;
  uint32_t buffer = 0;  // index into the base's buffers
  uint64_t data_offset = 0, data_bytes = 0, scale_offset = 0, scale_bytes = 0;
};

enum class BaseState { kLoading, kReady, kFailed, kPlanned };
const char* BaseStateName(BaseState state);

struct BaseSnapshot {
  uint64_t id = 0;
  uid_t uid = 0;
  std::string name, source, format;
  int block = 0;
  BaseState state = BaseState::kLoading;
  std::string error;
  uint64_t stored_bytes = 0;  // the host memory it holds
  uint64_t source_bytes = 0;  // the checkpoint's tensor bytes
  uint64_t read_bytes = 0;    // read so far (nvfp4 reads its tensors twice)
  uint64_t read_total = 0;
  double load_seconds = 0;
  std::vector<std::string> users;  // attached session ids
  std::optional<absl::Time> idle_since;
  std::vector<BufferRecord> buffers;
  std::vector<BaseTensor> tensors;
};

class BaseStore {
 public:
  struct Options {
    absl::Duration keep_warm = absl::Minutes(5);  // after the last user leaves
    uint64_t window_bytes = uint64_t{16} << 20;   // the reader's memory, per load
    uint64_t buffer_bytes = uint64_t{1} << 30;    // tensors are packed into buffers this big
    absl::Duration progress_every = absl::Seconds(2);  // base.progress events while loading
    unsigned load_threads = 0;  // tensors read at once per load; 0: up to 8, one per core
    // Whether a session still lives (the daemon's registry); unset: all do.
    std::function<bool(const Session& session)> session_alive;
  };
  BaseStore(const Options& options, Arena* arena, EventLog* events);
  ~BaseStore();  // stops loads in progress and waits for them
  BaseStore(const BaseStore&) = delete;
  BaseStore& operator=(const BaseStore&) = delete;

  // Attaches `session` to the base of that checkpoint and format, starting its load when no
  // base of the user holds it. Returns at once (state kLoading while it reads). Checks that
  // the caller may read every file; refuses with the numbers when host memory can't hold it.
  // With `granted`, the files are the descriptors the client handed over (its rights were
  // checked when it opened them) and nothing else is opened.
  absl::StatusOr<BaseSnapshot> Load(const Session& session, const BaseLoadRequest& request,
                                    const FileSource* granted = nullptr);
  // The base as it is now. NOT_FOUND for a base of another uid (unless `admin`).
  absl::StatusOr<BaseSnapshot> Get(uid_t uid, bool admin, uint64_t id) const;
  absl::Status Detach(const Session& session, uint64_t id);
  void OnSessionEnded(const Session& session);
  std::vector<BaseSnapshot> List(uid_t uid, bool admin) const;
  // A read-only segment of a base `session` is attached to, once it is ready. From then on the
  // base stays while the session lives, even detached: its pages stay in that process.
  absl::StatusOr<SegmentGrant> GrantSegment(const Session& session, uint64_t segment_id);
  // The daemon's own view of the buffers of a ready base `session` is attached to, in the
  // order of BaseSnapshot.buffers (a GPU pool is filled from it), held in memory while the pin
  // lives whatever the session does meanwhile. As with GrantSegment, the base also stays while
  // the session lives. FAILED_PRECONDITION while it loads or after it failed; NOT_FOUND when the
  // session is not attached to it.
  class HostPin {
   public:
    HostPin(BaseStore* store, uint64_t id, std::string token,
            std::vector<std::span<const uint8_t>> bytes)
        : store_(store), id_(id), token_(std::move(token)), bytes_(std::move(bytes)) {}
    ~HostPin() { store_->Unpin(id_, token_); }
    HostPin(const HostPin&) = delete;
    HostPin& operator=(const HostPin&) = delete;
    const std::vector<std::span<const uint8_t>>& bytes() const { return bytes_; }

   private:
    BaseStore* store_;
    uint64_t id_;
    std::string token_;
    std::vector<std::span<const uint8_t>> bytes_;
  };
  absl::StatusOr<std::unique_ptr<HostPin>> HostBytes(const Session& session, uint64_t id);
  // Frees the bases nobody has used for keep_warm.
  void ExpireIdle(absl::Time now);

 private:
  struct Base;
  void RunLoad(std::shared_ptr<Base> base);
  void Unpin(uint64_t id, const std::string& token);
  // Releases a base already taken out of `bases_`, and says so.
  void Free(const Base& base) ABSL_LOCKS_EXCLUDED(mu_);
  BaseSnapshot SnapshotLocked(const Base& base) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options options_;
  Arena* const arena_;
  EventLog* const events_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_pin_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::shared_ptr<Base>> bases_ ABSL_GUARDED_BY(mu_);
  int active_loaders_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_BASES_BASE_STORE_H_
