// SPDX-License-Identifier: Apache-2.0
// VramApi over the CUDA driver, loaded at run time (libcuda.so.1): the daemon starts on
// machines without one, and makes a CUDA context on a GPU only when it first makes a pool
// there. Without a driver (or a build without the toolkit's headers) every call says why.
#ifndef TRAINSTREAM_DAEMON_GPU_DRIVER_VRAM_API_H_
#define TRAINSTREAM_DAEMON_GPU_DRIVER_VRAM_API_H_

#include <memory>

#include "gpu/vram_api.h"

namespace trainstream::daemon {

std::unique_ptr<VramApi> LoadDriverVramApi();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_DRIVER_VRAM_API_H_
