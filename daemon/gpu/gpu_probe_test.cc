// SPDX-License-Identifier: Apache-2.0
#include "gpu/gpu_probe.h"

#include <cstring>

#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

int g_init_result = 0;
int g_count = 0;

CudaDriverEntryPoints FakeDriver() {
  CudaDriverEntryPoints d;
  d.init = [](unsigned int) { return g_init_result; };
  d.device_get_count = [](int* count) {
    *count = g_count;
    return 0;
  };
  d.device_get = [](int* device, int ordinal) {
    *device = ordinal;
    return 0;
  };
  d.device_get_name = [](char* name, int length, int device) {
    std::strncpy(name, "Fake H200", length);
    return 0;
  };
  d.device_total_mem = [](size_t* bytes, int device) {
    *bytes = size_t{141} << 30;
    return 0;
  };
  d.device_get_uuid = [](unsigned char uuid[16], int device) {
    for (int i = 0; i < 16; ++i) uuid[i] = static_cast<unsigned char>(i + device);
    return 0;
  };
  return d;
}

TEST(GpuProbeTest, ListsGpusWithUuids) {
  g_init_result = 0;
  g_count = 2;
  GpuInventory inventory = ProbeGpus(FakeDriver());
  ASSERT_EQ(inventory.gpus.size(), 2u);
  EXPECT_EQ(inventory.gpus[1].uuid, "GPU-01020304-0506-0708-090a-0b0c0d0e0f10");
  EXPECT_EQ(inventory.gpus[0].name, "Fake H200");
  EXPECT_EQ(inventory.gpus[0].total_bytes, size_t{141} << 30);
  EXPECT_TRUE(inventory.note.empty());
}

TEST(GpuProbeTest, MissingGpuIsANoteNotACrash) {
  g_init_result = 100;  // CUDA_ERROR_NO_DEVICE
  GpuInventory inventory = ProbeGpus(FakeDriver());
  EXPECT_TRUE(inventory.gpus.empty());
  EXPECT_NE(inventory.note.find("100"), std::string::npos);
  g_init_result = 0;
  g_count = 0;
  EXPECT_EQ(ProbeGpus(FakeDriver()).note, "the CUDA driver reports no GPU");
}

TEST(GpuProbeTest, InstalledProbeNeverFails) {
  GpuInventory inventory = ProbeInstalledGpus();
  EXPECT_TRUE(!inventory.gpus.empty() || !inventory.note.empty());
}

}  // namespace
}  // namespace trainstream::daemon
