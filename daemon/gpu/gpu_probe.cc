// SPDX-License-Identifier: Apache-2.0
#include "gpu/gpu_probe.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {

std::string FormatGpuUuid(const unsigned char b[16]) {
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
      b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

GpuInventory ProbeGpus(const CudaDriverEntryPoints& driver) {
  GpuInventory inventory;
  if (int rc = driver.init(0); rc != 0) {
    inventory.note = absl::StrCat("the CUDA driver did not initialise (CUresult ", rc,
                                  "); no GPU is used");
    return inventory;
  }
  int count = 0;
  if (int rc = driver.device_get_count(&count); rc != 0 || count == 0) {
    inventory.note = rc != 0 ? absl::StrCat("cuDeviceGetCount failed (CUresult ", rc, ")")
                             : "the CUDA driver reports no GPU";
    return inventory;
  }
  for (int i = 0; i < count; ++i) {
    int device = 0;
    if (driver.device_get(&device, i) != 0) continue;
    GpuDescription gpu;
    gpu.index = i;
    char name[256] = {};
    if (driver.device_get_name(name, sizeof(name) - 1, device) == 0) gpu.name = name;
    size_t bytes = 0;
    if (driver.device_total_mem(&bytes, device) == 0) gpu.total_bytes = bytes;
    unsigned char uuid[16] = {};
    if (driver.device_get_uuid(uuid, device) == 0) gpu.uuid = FormatGpuUuid(uuid);
    inventory.gpus.push_back(std::move(gpu));
  }
  return inventory;
}

GpuInventory ProbeInstalledGpus() {
  // Deliberately never dlclose()d: the driver library does not support being unloaded.
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    return {{}, "no CUDA driver on this machine (libcuda.so.1 not found); running CPU-only"};
  }
  CudaDriverEntryPoints driver;
  driver.init = reinterpret_cast<decltype(driver.init)>(::dlsym(library, "cuInit"));
  driver.device_get_count =
      reinterpret_cast<decltype(driver.device_get_count)>(::dlsym(library, "cuDeviceGetCount"));
  driver.device_get = reinterpret_cast<decltype(driver.device_get)>(::dlsym(library, "cuDeviceGet"));
  driver.device_get_name =
      reinterpret_cast<decltype(driver.device_get_name)>(::dlsym(library, "cuDeviceGetName"));
  driver.device_total_mem =
      reinterpret_cast<decltype(driver.device_total_mem)>(::dlsym(library, "cuDeviceTotalMem_v2"));
  driver.device_get_uuid =
      reinterpret_cast<decltype(driver.device_get_uuid)>(::dlsym(library, "cuDeviceGetUuid_v2"));
  if (!driver.init || !driver.device_get_count || !driver.device_get || !driver.device_get_name ||
      !driver.device_total_mem || !driver.device_get_uuid) {
    return {{}, "the CUDA driver library lacks entry points this daemon needs; it is too old"};
  }
  return ProbeGpus(driver);
}

}  // namespace trainstream::daemon
