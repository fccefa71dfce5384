// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_GPU_GPU_PROBE_H_
#define TRAINSTREAM_DAEMON_GPU_GPU_PROBE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::daemon {

struct GpuDescription {
  int index = 0;
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-...", as nvidia-smi prints it
  std::string name;
  uint64_t total_bytes = 0;
};

struct GpuInventory {
  std::vector<GpuDescription> gpus;
  std::string note;  // why there are none, when there are none
};

// The few CUDA driver entry points the probe needs. They are looked up at run time so that the
// daemon starts on machines without a driver and creates no CUDA context while probing.
struct CudaDriverEntryPoints {
  int (*init)(unsigned int flags) = nullptr;
  int (*device_get_count)(int* count) = nullptr;
  int (*device_get)(int* device, int ordinal) = nullptr;
  int (*device_get_name)(char* name, int length, int device) = nullptr;
  int (*device_total_mem)(size_t* bytes, int device) = nullptr;
  int (*device_get_uuid)(unsigned char uuid[16], int device) = nullptr;
};

// A GPU's 16 UUID bytes as nvidia-smi prints them: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
std::string FormatGpuUuid(const unsigned char bytes[16]);

// Lists the GPUs through `driver`; a failing call becomes the inventory's note.
GpuInventory ProbeGpus(const CudaDriverEntryPoints& driver);

// Loads libcuda.so.1 and probes; without the library the note says so.
GpuInventory ProbeInstalledGpus();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_GPU_PROBE_H_
