// SPDX-License-Identifier: Apache-2.0
// The placement of streamed frozen blocks over GPU pools, on simulated machines.
#include "gpu/pool_placement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trainstream::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kGiB = uint64_t{1} << 30;

PoolGpu Gpu(const std::string& uuid, uint64_t spare, double host_gbps = 55.0) {
  PoolGpu gpu;
  gpu.uuid = uuid;
  gpu.spare_bytes = spare;
  gpu.host_link_gbps = host_gbps;
  return gpu;
}

// Every ordered pair of `n` GPUs with peer access at `gbps`.
std::vector<PeerLink> AllPairs(int n, double gbps) {
  std::vector<PeerLink> links;
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a != b) links.push_back({a, b, true, gbps});
    }
  }
  return links;
}

TEST(PoolPlacement, NvlinkedGpusShareTheBlocksEvenlyAndTheRestStaysInHostMemory) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 4 * kGiB), Gpu("GPU-b", 4 * kGiB)};
  request.links = AllPairs(2, 300.0);  // NVLink: far above the 55 GB/s host links
  request.block_bytes.assign(10, kGiB);
  request.rank_gpus = {0, 1};
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  // Alternating, so that consecutive blocks come over different links.
  EXPECT_THAT(p->owner, ElementsAre(0, 1, 0, 1, 0, 1, 0, 1, -1, -1));
  EXPECT_THAT(p->pooled_bytes, ElementsAre(4 * kGiB, 4 * kGiB));
  EXPECT_TRUE(p->notes.empty());
}

TEST(PoolPlacement, PeerCopiesSlowerThanTheHostLinkLeavePoolingOffAndSayWhy) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 8 * kGiB), Gpu("GPU-b", 8 * kGiB)};
  request.links = AllPairs(2, 20.0);  // peer traffic through a PCIe switch, slower than host
  request.block_bytes.assign(4, kGiB);
  request.rank_gpus = {0, 1};
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->owner, ElementsAre(-1, -1, -1, -1));
  ASSERT_EQ(p->notes.size(), 2u);
  EXPECT_THAT(p->notes[0], HasSubstr("GPU-b copies from it at 20.0 GB/s, from host memory at "
                                     "55.0 GB/s"));
}

TEST(PoolPlacement, AMissingPeerAccessRulesOutOnlyTheGpusItConcerns) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 2 * kGiB), Gpu("GPU-b", 2 * kGiB), Gpu("GPU-c", 2 * kGiB)};
  request.links = AllPairs(3, 300.0);
  for (PeerLink& link : request.links) {
    if (link.from == 0 && link.to == 2) link.access = false;  // c cannot read a
  }
  request.block_bytes.assign(6, kGiB);
  request.rank_gpus = {0, 1, 2};
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->pooled_bytes[0], 0u);
  EXPECT_EQ(p->pooled_bytes[1] + p->pooled_bytes[2], 4 * kGiB);
  EXPECT_THAT(p->owner, ElementsAre(1, 2, 1, 2, -1, -1));
  ASSERT_EQ(p->notes.size(), 1u);
  EXPECT_THAT(p->notes[0], HasSubstr("GPU GPU-a holds no blocks: GPU GPU-c has no peer access"));
}

TEST(PoolPlacement, OneGpuWithTwoProcessesHoldsTheBaseForBothInPlace) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 10 * kGiB)};
  request.block_bytes.assign(8, kGiB);
  request.rank_gpus = {0, 0};  // two processes on one GPU: no peer links needed
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->owner, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_EQ(p->pooled_bytes[0], 8 * kGiB);
}

TEST(PoolPlacement, AGpuRunningNoRankLendsItsMemoryWhenEveryRankReadsItFast) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 0), Gpu("GPU-idle", 6 * kGiB)};
  request.links = AllPairs(2, 300.0);
  request.block_bytes = {2 * kGiB, 3 * kGiB, 2 * kGiB, 0};
  request.rank_gpus = {0};
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  // Whole blocks only: the third does not fit in the 1 GiB left; an empty one is not placed
  // (GPU-a, with no room, least of all).
  EXPECT_THAT(p->owner, ElementsAre(1, 1, -1, -1));
  EXPECT_EQ(p->pooled_bytes[1], 5 * kGiB);
}

TEST(PoolPlacement, AGpuWhoseMemoryCannotBeExportedIsSkippedWithTheReason) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", 4 * kGiB), Gpu("GPU-b", 4 * kGiB)};
  request.gpus[1].can_export = false;
  request.gpus[1].export_note = "neither VMM handles nor legacy IPC are supported";
  request.links = AllPairs(2, 300.0);
  request.block_bytes.assign(3, kGiB);
  request.rank_gpus = {0, 1};
  absl::StatusOr<Placement> p = PlaceBlocks(request);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->owner, ElementsAre(0, 0, 0));
  ASSERT_EQ(p->notes.size(), 1u);
  EXPECT_THAT(p->notes[0], HasSubstr("GPU GPU-b holds no blocks: its memory cannot be shared "
                                     "(neither VMM handles nor legacy IPC are supported)"));
}

TEST(PoolPlacement, RequestsThatDescribeNoSuchMachineAreRefused) {
  PlacementRequest request;
  request.gpus = {Gpu("GPU-a", kGiB), Gpu("GPU-b", kGiB)};
  request.block_bytes = {kGiB};
  EXPECT_THAT(PlaceBlocks(request).status().message(), HasSubstr("no ranks"));
  request.rank_gpus = {0, 5};
  EXPECT_THAT(PlaceBlocks(request).status().message(),
              HasSubstr("rank 1 runs on GPU 5; the request describes 2 GPUs"));
  request.rank_gpus = {0, 1};
  request.links = {{1, 1, true, 300.0}};
  EXPECT_EQ(PlaceBlocks(request).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace trainstream::daemon
