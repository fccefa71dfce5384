// SPDX-License-Identifier: Apache-2.0
#include "gpu/pool_placement.h"

#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

absl::Status Validate(const PlacementRequest& request) {
  const int n = static_cast<int>(request.gpus.size());
  if (request.rank_gpus.empty()) return absl::InvalidArgumentError("no ranks to place blocks for");
  for (size_t r = 0; r < request.rank_gpus.size(); ++r) {
    if (request.rank_gpus[r] < 0 || request.rank_gpus[r] >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d runs on GPU %d; the request describes %d GPUs", r, request.rank_gpus[r], n));
    }
  }
  for (const PeerLink& link : request.links) {
    if (link.from < 0 || link.from >= n || link.to < 0 || link.to >= n || link.from == link.to) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "peer link %d -> %d: not two of the %d GPUs described", link.from, link.to, n));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Placement> PlaceBlocks(const PlacementRequest& request) {
  if (absl::Status s = Validate(request); !s.ok()) return s;
  const int n = static_cast<int>(request.gpus.size());
  std::map<std::pair<int, int>, const PeerLink*> links;
  for (const PeerLink& link : request.links) links[{link.from, link.to}] = &link;
  const std::set<int> rank_gpus(request.rank_gpus.begin(), request.rank_gpus.end());

  Placement placement;
  placement.owner.assign(request.block_bytes.size(), -1);
  placement.pooled_bytes.assign(n, 0);
  // A GPU may hold blocks when every GPU that runs a rank reads from it faster than from host
  // memory: a rank for which it would be slower would stream from host anyway, and the block
  // must then be in host memory too, so the pool would save that rank nothing.
  std::vector<uint64_t> room(n, 0);
  for (int g = 0; g < n; ++g) {
    const PoolGpu& gpu = request.gpus[g];
    if (gpu.spare_bytes == 0) continue;
    if (!gpu.can_export) {
      placement.notes.push_back(absl::StrFormat(
          "GPU %s holds no blocks: its memory cannot be shared (%s)", gpu.uuid, gpu.export_note));
      continue;
    }
    bool eligible = true;
    for (int reader : rank_gpus) {
      if (reader == g) continue;  // its own ranks read the pool in place
      auto it = links.find({g, reader});
      const PoolGpu& to = request.gpus[reader];
      if (it == links.end() || !it->second->access) {
        placement.notes.push_back(absl::StrFormat(
            "GPU %s holds no blocks: GPU %s has no peer access to it", gpu.uuid, to.uuid));
        eligible = false;
        break;
      }
      if (it->second->gbps <= to.host_link_gbps) {
        placement.notes.push_back(absl::StrFormat(
            "GPU %s holds no blocks: GPU %s copies from it at %.1f GB/s, from host memory at "
            "%.1f GB/s",
            gpu.uuid, to.uuid, it->second->gbps, to.host_link_gbps));
        eligible = false;
        break;
      }
    }
    if (eligible) room[g] = gpu.spare_bytes;
  }
  // Spread: each block to the eligible GPU with the most room left that takes it whole.
  for (size_t b = 0; b < request.block_bytes.size(); ++b) {
    if (request.block_bytes[b] == 0) continue;  // nothing to hold
    int best = -1;
    for (int g = 0; g < n; ++g) {
      if (room[g] >= request.block_bytes[b] && (best < 0 || room[g] > room[best])) best = g;
    }
    if (best < 0) continue;
    placement.owner[b] = best;
    room[best] -= request.block_bytes[b];
    placement.pooled_bytes[best] += request.block_bytes[b];
  }
  return placement;
}

}  // namespace trainstream::daemon
