// SPDX-License-Identifier: Apache-2.0
// The trainstream client library: a session with trainstreamd, its shared host buffers, the
// doorbell, and inspection. No gRPC or protobuf type appears here.
#ifndef TRAINSTREAM_CLIENT_H_
#define TRAINSTREAM_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainstream/replies.h"

namespace trainstream::client {

struct SessionOptions {
  std::string socket_path;  // empty: FindDaemonSocket()
  std::string job_id;       // empty: "default"
  uint32_t rank = 0;
  uint32_t world_size = 1;
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Register every mapped segment with CUDA (pinned, DMA-capable) when a GPU is present.
  bool register_with_cuda = true;
};

struct AllocateOptions {
  std::string tag;
  uint64_t alignment = 0;  // 0: 4096
  bool sealable = false;   // may later be sealed read-only and shared
};

// A doorbell message (see ipc::DoorbellMessage for the kinds).
struct Notice {
  uint32_t kind = 0;
  uint64_t id = 0;
  uint64_t step = 0;
  uint64_t value = 0;
  uint32_t flags = 0;
};

class MappedSegment;
class HostOptimizer;

// A daemon GPU pool mapped into this process on one CUDA device (Session::ImportGpuPool):
// `bytes` at `device_pointer`, read-only where the driver allows it (`note` says otherwise).
// Unmapped on destruction, after the device has finished with it.
class GpuPoolMapping {
 public:
  enum class Kind { kVmm, kLegacyIpc };
  ~GpuPoolMapping();
  GpuPoolMapping(const GpuPoolMapping&) = delete;
  GpuPoolMapping& operator=(const GpuPoolMapping&) = delete;

  uint64_t pool_id() const { return pool_id_; }
  int device() const { return device_; }
  uint64_t device_pointer() const { return address_; }
  uint64_t bytes() const { return bytes_; }
  const char* kind() const { return kind_ == Kind::kVmm ? "vmm" : "legacy_ipc"; }
  bool read_only() const { return read_only_; }
  const std::string& note() const { return note_; }

 private:
  friend class GpuPoolMapper;  // the only maker: it owns what the destructor undoes
  GpuPoolMapping(uint64_t pool_id, int device, uint64_t device_pointer, uint64_t bytes, Kind kind,
                 bool read_only, std::string note)
      : pool_id_(pool_id),
        device_(device),
        address_(device_pointer),
        bytes_(bytes),
        kind_(kind),
        read_only_(read_only),
        note_(std::move(note)) {}
  uint64_t pool_id_;
  int device_;
  uint64_t address_;
  uint64_t bytes_;
  Kind kind_;
  bool read_only_;
  std::string note_;
};

// A buffer mapped into this process. Keeps its segment mapped (and CUDA-registered) while any
// HostBuffer of it lives. Immutable; the bytes may be used from any thread.
class HostBuffer {
 public:
  HostBuffer(BufferInfo info, std::shared_ptr<MappedSegment> segment);
  const BufferInfo& info() const { return info_; }
  uint8_t* data() const;
  uint64_t size() const { return info_.bytes; }
  bool writable() const;
  // True when the segment is registered with CUDA (copies are DMA at full PCIe speed).
  bool cuda_registered() const;
  // A DMA copy must not cross a multiple of this many bytes from the segment's start (the
  // driver took the segment in registrations of this size); 0 when unregistered.
  uint64_t registration_piece_bytes() const;
  const std::shared_ptr<MappedSegment>& segment() const { return segment_; }

 private:
  BufferInfo info_;
  std::shared_ptr<MappedSegment> segment_;
};

// One session: opens on Create(), attaches its data connection, renews its lease in a
// background thread, and closes on destruction. Every method is thread-safe. When the daemon
// goes away, calls fail with UNAVAILABLE naming the socket, within the RPC timeout.
class Session {
 public:
  static absl::StatusOr<std::unique_ptr<Session>> Create(const SessionOptions& options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const;
  const std::string& socket_path() const;
  // Closes the session; the daemon frees every buffer it owns. Idempotent. With `end_job`, the
  // job's optimizer state goes too when no other session of the job is open (otherwise it is
  // kept a while for a restarted process to re-attach).
  absl::Status Close(bool end_job = false);

  absl::StatusOr<std::shared_ptr<HostBuffer>> Allocate(const std::string& name, uint64_t bytes,
                                                       const AllocateOptions& options = {});
  // A buffer of this session's job by name (another session of the job may own it).
  absl::StatusOr<std::shared_ptr<HostBuffer>> Lookup(const std::string& name);
  absl::Status Free(const HostBuffer& buffer);
  // Seals a sealable buffer read-only for every process and returns the read-only view. This
  // process must hold no HostBuffer of it any more (its writable mapping would block the seal):
  // drop them and pass the buffer's info.
  absl::StatusOr<std::shared_ptr<HostBuffer>> Seal(const BufferInfo& buffer);

  // Renews the lease now (the background thread also does). One control-plane round trip.
  absl::Status Heartbeat();
  // What this process moved between host memory and its GPU for this session so far, by its own
  // count: the background heartbeats carry the latest totals to the daemon (for its metrics).
  // No round trip; totals only grow.
  void SetTransferTotals(uint64_t h2d_bytes, uint64_t d2h_bytes);

  // Doorbell: Ring() posts to the daemon; Wait() takes the next message from it (a background
  // thread drains the ring into a queue, so messages wait here however long the caller is busy).
  absl::Status Ring(const Notice& notice);
  absl::StatusOr<Notice> Wait(int timeout_ms);
  // One doorbell round trip (ping, pong); returns its duration.
  absl::StatusOr<absl::Duration> Ping();

  // Inspection.
  absl::StatusOr<DaemonStatus> GetStatus();
  absl::StatusOr<std::vector<SessionInfo>> ListSessions();
  absl::StatusOr<MemoryReport> GetMemory();
  // Events after `since_seq`, oldest first.
  absl::StatusOr<std::vector<Event>> ReadEvents(uint64_t since_seq);
  // Admission: declares all the host memory this session's job will hold (0 drops the plan),
  // waiting up to `wait` for room; RESOURCE_EXHAUSTED with the numbers when it does not fit.
  absl::StatusOr<HostPlan> PlanHostMemory(uint64_t bytes, absl::Duration wait);
  // Records a decision of this client in the daemon's event log (kind stored as
  // "client.<kind>"); returns the event's sequence number.
  absl::StatusOr<uint64_t> ReportEvent(const std::string& kind, const std::string& message,
                                       const std::vector<std::pair<std::string, double>>& numbers);

  // Shared frozen bases. LoadBase attaches this session to the base of a checkpoint (the
  // daemon reads it once per user and content, converting and quantizing as it reads) and
  // returns at once with its state; GetBase reads the state again
  // (progress while it loads, the tensor table once it is ready).
  struct LoadBaseOptions {
    std::string path;
    std::string format = "bf16";
    uint32_t block = 0;
    std::vector<std::string> quantize;
    std::string name;
    bool plan_only = false;  // only its size as stored (state "planned"); nothing is loaded
  };
  absl::StatusOr<BaseInfo> LoadBase(const LoadBaseOptions& options);
  absl::StatusOr<BaseInfo> GetBase(uint64_t base_id);
  absl::Status DetachBase(uint64_t base_id);
  absl::StatusOr<std::vector<BaseInfo>> ListBases();
  // A ready base's buffers, mapped read-only, in the order of BaseInfo.buffers.
  absl::StatusOr<std::vector<std::shared_ptr<HostBuffer>>> MapBase(uint64_t base_id);

  // GPU pools. PlaceBaseOnGpu puts a base this session is attached to in the daemon's pool on
  // the GPU named `gpu_uuid` (CudaDeviceUuid; one VRAM copy per base and GPU, shared by every
  // session that asks) and returns the pool; this session is one of its
  // importers until ReleaseGpuPool or its end. ImportGpuPool maps it on CUDA device `device`.
  absl::StatusOr<GpuPoolInfo> PlaceBaseOnGpu(uint64_t base_id, const std::string& gpu_uuid);
  absl::StatusOr<std::unique_ptr<GpuPoolMapping>> ImportGpuPool(uint64_t pool_id, int device);
  absl::Status ReleaseGpuPool(uint64_t pool_id);
  absl::StatusOr<GpuPools> ListGpuPools();

 private:
  friend class HostOptimizer;
  class Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The socket a daemon started without --socket listens on: $TRAINSTREAM_SOCKET, else the
// system socket for root, else the per-user one under $XDG_RUNTIME_DIR (or
// /tmp/trainstream-<uid>).
std::string DefaultSocketPath();

// The daemon a client uses when no socket is named: the one $TRAINSTREAM_SOCKET names, else the
// first with a daemon listening of the system socket (/run/trainstream/trainstreamd.sock, or
// $TRAINSTREAM_SYSTEM_SOCKET) and, for users other than root, the per-user one. UNAVAILABLE
// says why each was not used; PERMISSION_DENIED when a socket refused this user, naming its
// group.
absl::StatusOr<std::string> FindDaemonSocket();

// The UUID of CUDA device `device` as the driver and nvidia-smi write it ("GPU-xxxxxxxx-...").
absl::StatusOr<std::string> CudaDeviceUuid(int device);

// Control-plane round trip (GetStatus) against a daemon, without a session. For probes.
absl::StatusOr<absl::Duration> PingDaemon(const std::string& socket_path);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_H_
