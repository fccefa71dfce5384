// SPDX-License-Identifier: Apache-2.0
// The daemon's host AdamW pass on the full mixed-precision step (bf16 gradient in, fp32 master
// and moments or bf16 moments, bf16 parameter out), beside the memory bandwidth of an in-place
// stream over the same arrays on the same worker threads, in the same run.
//
//   host_adamw_bench --params=10000000 [--params=...] [--threads=N] [--repeats=7]
//                    [--isa=scalar|avx2|avx512] [--chunk=ELEMENTS]
// Prints a table and one JSON line per size. Bytes counted per parameter: gradient read 2,
// master read+write 8, moments read+write 16 (fp32) or 8 (bf16), parameter write 2: 28 or 20.
#include <sys/mman.h>
#include <sys/utsname.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/adamw.h"
#include "cpu/stream_probe.h"
#include "optimizer/thread_pool.h"

namespace {

using trainstream::daemon::ThreadPool;
namespace k = trainstream::kernels;

// Elements per task: about four tasks per worker, so the last round of tasks leaves few
// workers idle, and no task under 16K elements (its dispatch would cost more than its work).
size_t ChunkFor(size_t n, size_t threads) {
  size_t chunk = (n / (threads * 4) + 16383) / 16384 * 16384;
  return std::clamp<size_t>(chunk, 16384, size_t{1} << 20);
}

void* Allocate(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

template <typename Fn>
double MedianSeconds(int repeats, Fn&& fn) {
  fn();  // warm-up (and first touch)
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes;
  size_t threads = std::thread::hardware_concurrency();
  int repeats = 7;
  k::Isa isa = k::BestIsa();
  size_t chunk_override = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--params=", 0) == 0) sizes.push_back(std::stoull(a.substr(9)));
    if (a.rfind("--threads=", 0) == 0) threads = std::stoull(a.substr(10));
    if (a.rfind("--repeats=", 0) == 0) repeats = std::stoi(a.substr(10));
    if (a.rfind("--chunk=", 0) == 0) chunk_override = std::stoull(a.substr(8));
    if (a.rfind("--isa=", 0) == 0) {
      const std::string name = a.substr(6);
      isa = name == "scalar" ? k::Isa::kScalar : name == "avx2" ? k::Isa::kAvx2 : k::Isa::kAvx512;
      if (!k::IsaSupported(isa)) {
        std::fprintf(stderr, "this CPU lacks %s\n", name.c_str());
        return 2;
      }
    }
  }
  if (sizes.empty()) sizes = {10'000'000, 100'000'000};
  ThreadPool pool(threads, /*pin=*/true);
  utsname host{};
  uname(&host);
  std::printf("isa=%s threads=%zu\n", k::IsaName(isa), threads);
  std::printf("%12s %7s %12s %10s %12s %9s\n", "params", "moments", "adamw GB/s", "Mparam/s",
              "stream GB/s", "of stream");
  for (size_t n : sizes) {
    for (bool f32_moments : {true, false}) {
      const size_t moment_bytes = f32_moments ? 4 : 2;
      auto* grad = static_cast<uint16_t*>(Allocate(n * 2));
      auto* master = static_cast<float*>(Allocate(n * 4));
      void* m = Allocate(n * moment_bytes);
      void* v = Allocate(n * moment_bytes);
      auto* out = static_cast<uint16_t*>(Allocate(n * 2));
      const size_t kChunk = chunk_override ? chunk_override : ChunkFor(n, threads);
      const size_t chunks = (n + kChunk - 1) / kChunk;
      // First touch from the workers, chunk by chunk, as the daemon's pages would be placed.
      pool.ParallelFor(chunks, [&](size_t c) {
        size_t b = c * kChunk, e = std::min(n, b + kChunk);
        for (size_t i = b; i < e; ++i) {
          grad[i] = 0x3c00 + (i & 0xff);  // small positive bf16 values
          master[i] = 1.0f;
          out[i] = 0;
        }
        std::memset(static_cast<uint8_t*>(m) + b * moment_bytes, 0, (e - b) * moment_bytes);
        std::memset(static_cast<uint8_t*>(v) + b * moment_bytes, 0, (e - b) * moment_bytes);
      });
      const void* grads[] = {grad};
      k::AdamWTensor t;
      t.master = master;
      t.exp_avg = m;
      t.exp_avg_sq = v;
      t.moment_type = f32_moments ? k::ScalarType::kFloat32 : k::ScalarType::kBFloat16;
      t.grads = grads;
      t.grad_type = k::ScalarType::kBFloat16;
      t.param_out = out;
      t.param_type = k::ScalarType::kBFloat16;
      t.numel = n;
      uint64_t step_number = 0;
      double adamw = MedianSeconds(repeats, [&] {
        k::AdamWStep s;
        s.weight_decay = 0.01;
        k::SetStepNumber(&s, ++step_number);
        s.rounding_seed = step_number;
        pool.ParallelFor(chunks, [&](size_t c) {
          size_t b = c * kChunk, e = std::min(n, b + kChunk);
          (void)k::AdamWUpdate(t, b, e, s, isa);
        });
      });
      double stream = MedianSeconds(repeats, [&] {
        pool.ParallelFor(chunks, [&](size_t c) {
          size_t b = c * kChunk, e = std::min(n, b + kChunk);
          k::StreamProbe(grad, master, m, v, f32_moments, out, b, e);
        });
      });
      const double bytes = static_cast<double>(n) * (f32_moments ? 28 : 20);
      const double adamw_gbps = bytes / adamw / 1e9, stream_gbps = bytes / stream / 1e9;
      std::printf("%12zu %7s %12.1f %10.1f %12.1f %8.1f%%\n", n, f32_moments ? "fp32" : "bf16",
                  adamw_gbps, n / adamw / 1e6, stream_gbps, 100 * adamw_gbps / stream_gbps);
      std::printf(
          "{\"bench\":\"host_adamw\",\"host\":\"%s\",\"isa\":\"%s\",\"threads\":%zu,"
          "\"params\":%zu,\"moments\":\"%s\",\"bytes_per_param\":%d,\"adamw_s\":%.6f,"
          "\"adamw_gbps\":%.2f,\"stream_s\":%.6f,\"stream_gbps\":%.2f}\n",
          host.nodename, k::IsaName(isa), threads, n, f32_moments ? "fp32" : "bf16",
          f32_moments ? 28 : 20, adamw, adamw_gbps, stream, stream_gbps);
      munmap(grad, n * 2);
      munmap(master, n * 4);
      munmap(m, n * moment_bytes);
      munmap(v, n * moment_bytes);
      munmap(out, n * 2);
    }
  }
  return 0;
}
