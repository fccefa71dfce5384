// SPDX-License-Identifier: Apache-2.0
// The fuzz input as a file the daemon's readers can open by path: a memfd, named through
// /proc/self/fd (a regular file, as the readers require), rewritten for each input, so that no
// execution touches the disk.
#ifndef TRAINSTREAM_TESTS_FUZZ_FUZZ_FILE_H_
#define TRAINSTREAM_TESTS_FUZZ_FUZZ_FILE_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace trainstream::fuzz {

class FuzzFile {
 public:
  FuzzFile() : fd_(::memfd_create("trainstream-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~FuzzFile() { ::close(fd_); }
  FuzzFile(const FuzzFile&) = delete;
  FuzzFile& operator=(const FuzzFile&) = delete;

  // Makes the file hold exactly `data`.
  const std::string& Write(const uint8_t* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

}  // namespace trainstream::fuzz

#endif  // TRAINSTREAM_TESTS_FUZZ_FUZZ_FILE_H_
