// SPDX-License-Identifier: Apache-2.0
// The memory bandwidth the AdamW pass is held to: an in-place read-modify-write stream over the
// same arrays with the same element types, doing almost no arithmetic. Benchmarks report the
// optimizer's GB/s beside this probe's, measured in the same run with the same threads.
#ifndef TRAINSTREAM_KERNELS_CPU_STREAM_PROBE_H_
#define TRAINSTREAM_KERNELS_CPU_STREAM_PROBE_H_

#include <cstddef>
#include <cstdint>

namespace trainstream::kernels {

// Reads grad (bf16), updates master (f32) and both moments (f32 when `moments_f32`, else bf16)
// in place, and writes out (bf16), over [begin, end).
void StreamProbe(const uint16_t* grad, float* master, void* m, void* v, bool moments_f32,
                 uint16_t* out, size_t begin, size_t end);

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CPU_STREAM_PROBE_H_
