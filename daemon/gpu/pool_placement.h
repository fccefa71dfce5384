// SPDX-License-Identifier: Apache-2.0
// Where the frozen blocks that ranks would stream from host memory live instead: in the spare
// VRAM of the machine's GPUs (the daemon's pools), each rank copying a block from the GPU that
// holds it, when that copy measures faster than the rank's own host link. A pure function of
// the machine's topology and measurements, so that it is tested on simulated topologies.
#ifndef TRAINSTREAM_DAEMON_GPU_POOL_PLACEMENT_H_
#define TRAINSTREAM_DAEMON_GPU_POOL_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainstream::daemon {

struct PoolGpu {
  std::string uuid;            // GPUs are named by UUID, never by index
  uint64_t spare_bytes = 0;    // VRAM the pool may take on it, its own ranks' plans served first
  double host_link_gbps = 0;   // host-to-device bandwidth measured on it
  bool can_export = true;      // the daemon can export VRAM from it (VMM or legacy IPC)
  std::string export_note;     // why not, when it can't
};

// A measured GPU-to-GPU copy: `to` reads from `from`'s memory.
struct PeerLink {
  int from = 0;                // indices into PlacementRequest::gpus
  int to = 0;
  bool access = false;         // cudaDeviceCanAccessPeer and enabled
  double gbps = 0;             // measured copy bandwidth, from -> to
};

struct PlacementRequest {
  std::vector<PoolGpu> gpus;
  std::vector<PeerLink> links;       // absent pairs have no peer access
  std::vector<uint64_t> block_bytes; // the blocks every rank streams, in the order they run
  std::vector<int> rank_gpus;        // the GPU each rank runs on
};

struct Placement {
  std::vector<int> owner;            // per block: the GPU holding it, -1 for host memory
  std::vector<uint64_t> pooled_bytes;  // per GPU: the blocks it holds
  // Per GPU that could hold blocks but may not, and per pair whose copies do not help, why: the
  // event log's lines.
  std::vector<std::string> notes;
};

// Decides the placement. A GPU may hold blocks only when every rank's GPU reads it faster than
// that rank's host link (its own ranks read it in place); blocks are spread over those GPUs, the
// one with the most spare memory left taking the next block, so copies fan out over the links.
// INVALID_ARGUMENT for a request that names GPUs that are not there or has no ranks.
absl::StatusOr<Placement> PlaceBlocks(const PlacementRequest& request);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_POOL_PLACEMENT_H_
