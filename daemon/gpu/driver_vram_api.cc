// SPDX-License-Identifier: Apache-2.0
#include "gpu/driver_vram_api.h"

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "gpu/gpu_probe.h"

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda.h>
#endif

namespace trainstream::daemon {
namespace {

// Every call refused, with the reason (no driver, or no headers to call it with).
class UnavailableVramApi : public VramApi {
 public:
  explicit UnavailableVramApi(std::string why) : why_(std::move(why)) {}
  absl::Status CheckFdHandles(const std::string&) override {
    return absl::UnavailableError(why_);
  }
  absl::StatusOr<VmmAllocation> CreateExportable(const std::string&, uint64_t) override {
    return absl::UnavailableError(why_);
  }
  void ReleaseExportable(const VmmAllocation&) override {}
  absl::StatusOr<LegacyAllocation> CreateLegacy(const std::string&, uint64_t) override {
    return absl::UnavailableError(why_);
  }
  void ReleaseLegacy(const LegacyAllocation&) override {}
  absl::Status WriteExportable(const VmmAllocation&, std::span<const HostPiece>) override {
    return absl::UnavailableError(why_);
  }
  absl::Status WriteLegacy(const LegacyAllocation&, std::span<const HostPiece>) override {
    return absl::UnavailableError(why_);
  }

 private:
  std::string why_;
};

#ifdef TRAINSTREAM_HAVE_CUDA

struct DriverCalls {
  CUresult (*init)(unsigned int);
  CUresult (*get_error_string)(CUresult, const char**);
  CUresult (*device_get_count)(int*);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*device_get_uuid)(CUuuid*, CUdevice);
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*primary_ctx_release)(CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);
  CUresult (*mem_export)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*mem_alloc)(CUdeviceptr*, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*ipc_get_mem_handle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long);
  CUresult (*mem_unmap)(CUdeviceptr, size_t);
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t);
  CUresult (*ctx_synchronize)();
};

class DriverVramApi : public VramApi {
 public:
  explicit DriverVramApi(DriverCalls calls) : cuda_(calls) {}
  ~DriverVramApi() override {
    absl::MutexLock lock(&mu_);
    for (const auto& [uuid, device] : devices_) cuda_.primary_ctx_release(device.device);
  }

  absl::Status CheckFdHandles(const std::string& uuid) override {
    absl::StatusOr<Device> device = Use(uuid);
    if (!device.ok()) return device.status();
    int vmm = 0, fd = 0;
    if (CUresult rc = cuda_.device_get_attribute(
            &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device->device);
        rc != CUDA_SUCCESS) {
      return Failed("cuDeviceGetAttribute", rc);
    }
    if (!vmm) return absl::UnimplementedError(absl::StrCat(uuid, " has no virtual memory management"));
    if (CUresult rc = cuda_.device_get_attribute(
            &fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device->device);
        rc != CUDA_SUCCESS) {
      return Failed("cuDeviceGetAttribute", rc);
    }
    if (!fd) {
      return absl::UnimplementedError(
          absl::StrCat(uuid, " does not export memory as POSIX file descriptors"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<VmmAllocation> CreateExportable(const std::string& uuid,
                                                 uint64_t bytes) override {
    absl::StatusOr<Device> device = Use(uuid);
    if (!device.ok()) return device.status();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device->ordinal;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (CUresult rc = cuda_.granularity(&granularity, &prop,
                                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        rc != CUDA_SUCCESS) {
      return Failed("cuMemGetAllocationGranularity", rc);
    }
    VmmAllocation out;
    out.uuid = uuid;
    out.bytes = (bytes + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle handle = 0;
    if (CUresult rc = cuda_.mem_create(&handle, out.bytes, &prop, 0); rc != CUDA_SUCCESS) {
      return Failed("cuMemCreate", rc);
    }
    int fd = -1;
    if (CUresult rc = cuda_.mem_export(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        rc != CUDA_SUCCESS) {
      cuda_.mem_release(handle);
      return Failed("cuMemExportToShareableHandle", rc);
    }
    out.handle = handle;
    out.fd = ipc::UniqueFd(fd);
    return out;
  }

  void ReleaseExportable(const VmmAllocation& allocation) override {
    // Importers' mappings keep the physical memory until they unmap: the driver counts them.
    if (Use(allocation.uuid).ok()) cuda_.mem_release(allocation.handle);
  }

  absl::StatusOr<LegacyAllocation> CreateLegacy(const std::string& uuid,
                                                uint64_t bytes) override {
    absl::StatusOr<Device> device = Use(uuid);
    if (!device.ok()) return device.status();
    LegacyAllocation out;
    out.uuid = uuid;
    out.bytes = bytes;
    CUdeviceptr pointer = 0;
    if (CUresult rc = cuda_.mem_alloc(&pointer, bytes); rc != CUDA_SUCCESS) {
      return Failed("cuMemAlloc", rc);
    }
    CUipcMemHandle handle{};
    if (CUresult rc = cuda_.ipc_get_mem_handle(&handle, pointer); rc != CUDA_SUCCESS) {
      cuda_.mem_free(pointer);
      return Failed("cuIpcGetMemHandle", rc);
    }
    static_assert(sizeof(handle) == sizeof(out.handle));
    std::memcpy(out.handle.data(), &handle, sizeof(handle));
    out.device_pointer = pointer;
    return out;
  }

  void ReleaseLegacy(const LegacyAllocation& allocation) override {
    if (Use(allocation.uuid).ok()) {
      cuda_.mem_free(static_cast<CUdeviceptr>(allocation.device_pointer));
    }
  }

  absl::Status WriteExportable(const VmmAllocation& allocation,
                               std::span<const HostPiece> pieces) override {
    absl::StatusOr<Device> device = Use(allocation.uuid);
    if (!device.ok()) return device.status();
    // The daemon maps the allocation only while it fills it: the importers' mappings are
    // their own.
    CUdeviceptr base = 0;
    if (CUresult rc = cuda_.address_reserve(&base, allocation.bytes, 0, 0, 0);
        rc != CUDA_SUCCESS) {
      return Failed("cuMemAddressReserve", rc);
    }
    absl::Status status = absl::OkStatus();
    bool mapped = false;
    if (CUresult rc = cuda_.mem_map(base, allocation.bytes, 0, allocation.handle, 0);
        rc != CUDA_SUCCESS) {
      status = Failed("cuMemMap", rc);
    } else {
      mapped = true;
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = device->ordinal;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if (CUresult rc = cuda_.mem_set_access(base, allocation.bytes, &access, 1);
          rc != CUDA_SUCCESS) {
        status = Failed("cuMemSetAccess", rc);
      }
    }
    if (status.ok()) status = Copy(base, allocation.bytes, pieces);
    if (mapped) cuda_.mem_unmap(base, allocation.bytes);
    cuda_.address_free(base, allocation.bytes);
    return status;
  }

  absl::Status WriteLegacy(const LegacyAllocation& allocation,
                           std::span<const HostPiece> pieces) override {
    absl::StatusOr<Device> device = Use(allocation.uuid);
    if (!device.ok()) return device.status();
    return Copy(static_cast<CUdeviceptr>(allocation.device_pointer), allocation.bytes, pieces);
  }

 private:
  struct Device {
    CUdevice device = 0;
    int ordinal = 0;
    CUcontext context = nullptr;
  };

  absl::Status Copy(CUdeviceptr base, uint64_t bytes, std::span<const HostPiece> pieces) {
    for (const HostPiece& piece : pieces) {
      if (piece.offset > bytes || piece.bytes > bytes - piece.offset) {
        return absl::OutOfRangeError(absl::StrFormat(
            "%d bytes at %d do not fit a pool of %d", piece.bytes, piece.offset, bytes));
      }
      if (CUresult rc = cuda_.memcpy_htod(base + piece.offset, piece.data, piece.bytes);
          rc != CUDA_SUCCESS) {
        return Failed("cuMemcpyHtoD", rc);
      }
    }
    // A copy from pageable memory may return before it has landed: the pool is complete (and
    // may be unmapped here, or handed out) only once the device says so.
    if (CUresult rc = cuda_.ctx_synchronize(); rc != CUDA_SUCCESS) {
      return Failed("cuCtxSynchronize", rc);
    }
    return absl::OkStatus();
  }

  absl::Status Failed(const char* call, CUresult rc) const {
    const char* text = nullptr;
    cuda_.get_error_string(rc, &text);
    return absl::InternalError(
        absl::StrFormat("%s failed: %s (CUresult %d)", call, text ? text : "?", rc));
  }

  // The device named `uuid`, its primary context made current on this thread (retained the
  // first time: the daemon's context on that GPU from then on).
  absl::StatusOr<Device> Use(const std::string& uuid) {
    absl::MutexLock lock(&mu_);
    auto known = devices_.find(uuid);
    if (known == devices_.end()) {
      int count = 0;
      if (CUresult rc = cuda_.device_get_count(&count); rc != CUDA_SUCCESS) {
        return Failed("cuDeviceGetCount", rc);
      }
      for (int i = 0; i < count && known == devices_.end(); ++i) {
        Device d;
        CUuuid id{};
        if (cuda_.device_get(&d.device, i) != CUDA_SUCCESS ||
            cuda_.device_get_uuid(&id, d.device) != CUDA_SUCCESS ||
            FormatGpuUuid(reinterpret_cast<const unsigned char*>(id.bytes)) != uuid) {
          continue;
        }
        d.ordinal = i;
        if (CUresult rc = cuda_.primary_ctx_retain(&d.context, d.device); rc != CUDA_SUCCESS) {
          return Failed("cuDevicePrimaryCtxRetain", rc);
        }
        known = devices_.emplace(uuid, d).first;
      }
      if (known == devices_.end()) return absl::NotFoundError(absl::StrCat("no GPU ", uuid));
    }
    if (CUresult rc = cuda_.ctx_set_current(known->second.context); rc != CUDA_SUCCESS) {
      return Failed("cuCtxSetCurrent", rc);
    }
    return known->second;
  }

  DriverCalls cuda_;
  absl::Mutex mu_;  // pools are filled outside GpuPools' lock
  std::map<std::string, Device> devices_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
bool Find(void* library, const char* name, T* out) {
  *out = reinterpret_cast<T>(::dlsym(library, name));
  return *out != nullptr;
}

#endif  // TRAINSTREAM_HAVE_CUDA

}  // namespace

std::unique_ptr<VramApi> LoadDriverVramApi() {
#ifdef TRAINSTREAM_HAVE_CUDA
  // Never dlclose()d: the driver library does not support being unloaded.
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    return std::make_unique<UnavailableVramApi>(
        "no CUDA driver on this machine (libcuda.so.1 not found): no GPU pools");
  }
  DriverCalls calls{};
  const bool found =
      Find(library, "cuInit", &calls.init) &&
      Find(library, "cuGetErrorString", &calls.get_error_string) &&
      Find(library, "cuDeviceGetCount", &calls.device_get_count) &&
      Find(library, "cuDeviceGet", &calls.device_get) &&
      Find(library, "cuDeviceGetUuid_v2", &calls.device_get_uuid) &&
      Find(library, "cuDeviceGetAttribute", &calls.device_get_attribute) &&
      Find(library, "cuDevicePrimaryCtxRetain", &calls.primary_ctx_retain) &&
      Find(library, "cuDevicePrimaryCtxRelease_v2", &calls.primary_ctx_release) &&
      Find(library, "cuCtxSetCurrent", &calls.ctx_set_current) &&
      Find(library, "cuMemGetAllocationGranularity", &calls.granularity) &&
      Find(library, "cuMemCreate", &calls.mem_create) &&
      Find(library, "cuMemExportToShareableHandle", &calls.mem_export) &&
      Find(library, "cuMemRelease", &calls.mem_release) &&
      Find(library, "cuMemAlloc_v2", &calls.mem_alloc) &&
      Find(library, "cuMemFree_v2", &calls.mem_free) &&
      Find(library, "cuIpcGetMemHandle", &calls.ipc_get_mem_handle) &&
      Find(library, "cuMemAddressReserve", &calls.address_reserve) &&
      Find(library, "cuMemAddressFree", &calls.address_free) &&
      Find(library, "cuMemMap", &calls.mem_map) &&
      Find(library, "cuMemUnmap", &calls.mem_unmap) &&
      Find(library, "cuMemSetAccess", &calls.mem_set_access) &&
      Find(library, "cuMemcpyHtoD_v2", &calls.memcpy_htod) &&
      Find(library, "cuCtxSynchronize", &calls.ctx_synchronize);
  if (!found) {
    return std::make_unique<UnavailableVramApi>(
        "the CUDA driver library lacks the virtual-memory and IPC entry points: it is too old");
  }
  if (CUresult rc = calls.init(0); rc != CUDA_SUCCESS) {
    return std::make_unique<UnavailableVramApi>(
        absl::StrCat("the CUDA driver did not initialise (CUresult ", rc, "): no GPU pools"));
  }
  return std::make_unique<DriverVramApi>(calls);
#else
  return std::make_unique<UnavailableVramApi>(
      "this build of trainstreamd has no CUDA support: no GPU pools");
#endif
}

}  // namespace trainstream::daemon
