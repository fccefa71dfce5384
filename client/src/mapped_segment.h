// SPDX-License-Identifier: Apache-2.0
// Internal: one daemon segment mapped into this process.
#ifndef TRAINSTREAM_CLIENT_SRC_MAPPED_SEGMENT_H_
#define TRAINSTREAM_CLIENT_SRC_MAPPED_SEGMENT_H_

#include <cstdint>
#include <memory>

#include "cuda_host_registration.h"
#include "ipc/shared_mapping.h"

namespace trainstream::client {

// The mapping and, when a GPU is present, its CUDA registration; unregistered before unmap
// (member order). Immutable after construction.
class MappedSegment {
 public:
  MappedSegment(uint64_t id, ipc::SharedMapping mapping,
                std::unique_ptr<CudaHostRegistration> registration)
      : id_(id), mapping_(std::move(mapping)), registration_(std::move(registration)) {}

  uint64_t id() const { return id_; }
  uint8_t* data() const { return mapping_.data(); }
  uint64_t size() const { return mapping_.size(); }
  bool writable() const { return mapping_.writable(); }
  bool cuda_registered() const { return registration_ != nullptr; }
  // A copy must not cross a multiple of this from the segment's start (see
  // CudaHostRegistration::piece_bytes); 0 when unregistered.
  uint64_t registration_piece_bytes() const {
    return registration_ ? registration_->piece_bytes() : 0;
  }

 private:
  uint64_t id_;
  ipc::SharedMapping mapping_;
  std::unique_ptr<CudaHostRegistration> registration_;  // destroyed first
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_MAPPED_SEGMENT_H_
