// SPDX-License-Identifier: Apache-2.0
#include "gpu_pool_mapping.h"

#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda_host_registration.h"
#include "trainstream/status_macros.h"

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace trainstream::client {

class GpuPoolMapper {
 public:
  static std::unique_ptr<GpuPoolMapping> Make(uint64_t pool_id, int device, uint64_t address,
                                              uint64_t bytes, GpuPoolMapping::Kind kind,
                                              bool read_only, std::string note) {
    return std::unique_ptr<GpuPoolMapping>(new GpuPoolMapping(
        pool_id, device, address, bytes, kind, read_only, std::move(note)));
  }
};

#ifdef TRAINSTREAM_HAVE_CUDA
namespace {

// The driver calls a mapping needs, found through the runtime (the client links no libcuda:
// it must load on machines without a driver).
struct DriverCalls {
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*ipc_open)(CUdeviceptr*, CUipcMemHandle, unsigned int);
  CUresult (*ipc_close)(CUdeviceptr);
  CUresult (*error_string)(CUresult, const char**);
};

absl::StatusOr<const DriverCalls*> Driver() {
  static std::once_flag once;
  static DriverCalls calls{};
  static absl::Status status;
  std::call_once(once, [] {
    auto find = [](const char* name, auto* out) {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
              cudaSuccess ||
          found != cudaDriverEntryPointSuccess || fn == nullptr) {
        cudaGetLastError();
        status = absl::UnavailableError(
            absl::StrCat("the CUDA driver lacks ", name, ": it is too old for GPU pools"));
        return false;
      }
      *out = reinterpret_cast<std::remove_pointer_t<decltype(out)>>(fn);
      return true;
    };
    find("cuMemImportFromShareableHandle", &calls.import_handle) &&
        find("cuMemAddressReserve", &calls.address_reserve) &&
        find("cuMemAddressFree", &calls.address_free) && find("cuMemMap", &calls.map) &&
        find("cuMemUnmap", &calls.unmap) && find("cuMemSetAccess", &calls.set_access) &&
        find("cuMemRelease", &calls.release) && find("cuIpcOpenMemHandle", &calls.ipc_open) &&
        find("cuIpcCloseMemHandle", &calls.ipc_close) &&
        find("cuGetErrorString", &calls.error_string);
  });
  if (!status.ok()) return status;
  return &calls;
}

absl::Status Failed(const DriverCalls& cuda, const char* call, CUresult rc) {
  const char* text = nullptr;
  cuda.error_string(rc, &text);
  return absl::InternalError(
      absl::StrFormat("%s failed: %s (CUresult %d)", call, text ? text : "?", rc));
}

// Makes `device`'s primary context (torch's, in a PyTorch process) current on this thread for
// its lifetime, and puts back the device the thread had: the caller's current device is its own.
class DeviceScope {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceScope>> Enter(int device) {
    std::string why;
    if (!CudaDevicePresent(&why)) return absl::UnavailableError(why);
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) {
      cudaGetLastError();
      previous = -1;
    }
    if (cudaError_t rc = cudaSetDevice(device); rc != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(rc)));
    }
    cudaFree(nullptr);  // makes the primary context if nothing has yet
    return std::unique_ptr<DeviceScope>(new DeviceScope(previous));
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  explicit DeviceScope(int previous) : previous_(previous) {}
  int previous_;
};

}  // namespace

absl::StatusOr<std::string> CudaDeviceUuid(int device) {
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceScope> scope, DeviceScope::Enter(device));
  cudaDeviceProp properties{};
  if (cudaError_t rc = cudaGetDeviceProperties(&properties, device); rc != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaGetDeviceProperties: ", cudaGetErrorString(rc)));
  }
  const auto* b = reinterpret_cast<const unsigned char*>(properties.uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
      b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapVmmPool(uint64_t pool_id, int device,
                                                           ipc::UniqueFd fd, uint64_t bytes) {
  ASSIGN_OR_RETURN(const DriverCalls* cuda, Driver());
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceScope> scope, DeviceScope::Enter(device));
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult rc = cuda->import_handle(&handle, reinterpret_cast<void*>(
                                                     static_cast<uintptr_t>(fd.get())),
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      rc != CUDA_SUCCESS) {
    return Failed(*cuda, "cuMemImportFromShareableHandle", rc);
  }
  CUdeviceptr address = 0;
  if (CUresult rc = cuda->address_reserve(&address, bytes, 0, 0, 0); rc != CUDA_SUCCESS) {
    cuda->release(handle);
    return Failed(*cuda, "cuMemAddressReserve", rc);
  }
  if (CUresult rc = cuda->map(address, bytes, 0, handle, 0); rc != CUDA_SUCCESS) {
    cuda->address_free(address, bytes);
    cuda->release(handle);
    return Failed(*cuda, "cuMemMap", rc);
  }
  // The mapping holds the memory from here; the imported handle is not needed any more.
  cuda->release(handle);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  std::string note;
  bool read_only = true;
  if (CUresult rc = cuda->set_access(address, bytes, &access, 1); rc != CUDA_SUCCESS) {
    // Some drivers refuse read-only access to device memory: frozen by convention then.
    const char* text = nullptr;
    cuda->error_string(rc, &text);
    note = absl::StrCat("the driver refused read-only access (", text ? text : "?",
                        "): mapped read-write");
    read_only = false;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (CUresult again = cuda->set_access(address, bytes, &access, 1); again != CUDA_SUCCESS) {
      cuda->unmap(address, bytes);
      cuda->address_free(address, bytes);
      return Failed(*cuda, "cuMemSetAccess", again);
    }
  }
  return GpuPoolMapper::Make(pool_id, device, address, bytes, GpuPoolMapping::Kind::kVmm,
                             read_only, std::move(note));
}

absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapLegacyPool(
    uint64_t pool_id, int device, const std::array<uint8_t, 64>& handle, uint64_t bytes) {
  ASSIGN_OR_RETURN(const DriverCalls* cuda, Driver());
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceScope> scope, DeviceScope::Enter(device));
  CUipcMemHandle ipc{};
  static_assert(sizeof(ipc) == sizeof(handle));
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  CUdeviceptr address = 0;
  if (CUresult rc = cuda->ipc_open(&address, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      rc != CUDA_SUCCESS) {
    return Failed(*cuda, "cuIpcOpenMemHandle", rc);
  }
  return GpuPoolMapper::Make(
      pool_id, device, address, bytes, GpuPoolMapping::Kind::kLegacyIpc, false,
      "a legacy IPC handle can't be mapped read-only: frozen by convention");
}

GpuPoolMapping::~GpuPoolMapping() {
  absl::StatusOr<const DriverCalls*> cuda = Driver();
  absl::StatusOr<std::unique_ptr<DeviceScope>> scope = DeviceScope::Enter(device_);
  if (!cuda.ok() || !scope.ok()) return;
  // Kernels may still read it: unmapping under them would fault.
  cudaDeviceSynchronize();
  if (kind_ == Kind::kVmm) {
    (*cuda)->unmap(static_cast<CUdeviceptr>(address_), bytes_);
    (*cuda)->address_free(static_cast<CUdeviceptr>(address_), bytes_);
  } else {
    (*cuda)->ipc_close(static_cast<CUdeviceptr>(address_));
  }
}

#else  // no CUDA in this build

absl::StatusOr<std::string> CudaDeviceUuid(int) {
  return absl::UnavailableError("this build of trainstream has no CUDA support");
}
absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapVmmPool(uint64_t, int, ipc::UniqueFd,
                                                           uint64_t) {
  return absl::UnavailableError("this build of trainstream has no CUDA support");
}
absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapLegacyPool(uint64_t, int,
                                                              const std::array<uint8_t, 64>&,
                                                              uint64_t) {
  return absl::UnavailableError("this build of trainstream has no CUDA support");
}
GpuPoolMapping::~GpuPoolMapping() = default;

#endif

}  // namespace trainstream::client
