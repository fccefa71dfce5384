// SPDX-License-Identifier: Apache-2.0
// The checkpoint writer: every byte lands in order whichever way it goes (direct from offset 0,
// through the page cache otherwise), across staging pieces and with a partial last block, and
// the descriptor's flags are left as they were.
#include "optimizer/checkpoint_file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {
namespace {

class CheckpointFileWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = absl::StrCat(::testing::TempDir(), "/checkpoint_file_writer_", ::getpid(), "_",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { ::unlink(path_.c_str()); }

  ipc::UniqueFd Create() {
    return ipc::UniqueFd(::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  }

  // Whether this directory's file system takes O_DIRECT at all: where it does not, the writer
  // must still write every byte, through the page cache.
  bool FileSystemTakesDirectIo() {
    ipc::UniqueFd probe(::open(path_.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0600));
    return probe.valid();
  }

  std::string Read() {
    std::ifstream in(path_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  std::string path_;
};

std::string RandomBytes(uint64_t n, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(random());
  return out;
}

// Sizes that start and end inside the 8 MiB staging pieces and the 4 KiB blocks: a header's
// length field, an odd header, arrays smaller and larger than a piece, one exactly a piece.
const std::vector<uint64_t> kPieces = {8, 1234, (3u << 20) + 17, (9u << 20) + 5, 1, 8u << 20, 4095};

TEST_F(CheckpointFileWriterTest, WritesEveryByteInOrderFromOffsetZero) {
  const bool direct_possible = FileSystemTakesDirectIo();
  ipc::UniqueFd fd = Create();
  ASSERT_TRUE(fd.valid());
  const int flags_before = ::fcntl(fd.get(), F_GETFL);
  std::string expected;
  {
    CheckpointFileWriter writer(fd.get(), path_);
    EXPECT_EQ(writer.direct(), direct_possible) << "O_DIRECT is taken here, so it should be used";
    uint32_t seed = 1;
    for (uint64_t n : kPieces) {
      const std::string piece = RandomBytes(n, seed++);
      ASSERT_TRUE(writer.Write(piece.data(), piece.size()).ok());
      expected += piece;
    }
    ASSERT_TRUE(writer.Finish().ok());
  }
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL), flags_before) << "the shared descriptor's flags changed";
  ASSERT_NE(expected.size() % 4096, 0u) << "the sizes should leave a partial last block";
  const std::string written = Read();
  ASSERT_EQ(written.size(), expected.size());
  EXPECT_TRUE(written == expected) << "the file's bytes differ from those written";
}

TEST_F(CheckpointFileWriterTest, AWholeNumberOfBlocksLeavesNoTail) {
  ipc::UniqueFd fd = Create();
  ASSERT_TRUE(fd.valid());
  const std::string bytes = RandomBytes((16u << 20) + 4096 * 3, 7);
  CheckpointFileWriter writer(fd.get(), path_);
  ASSERT_TRUE(writer.Write(bytes.data(), bytes.size()).ok());
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_TRUE(Read() == bytes);
}

TEST_F(CheckpointFileWriterTest, AFileNotAtItsStartGoesThroughThePageCache) {
  ipc::UniqueFd fd = Create();
  ASSERT_TRUE(fd.valid());
  const std::string before = "written earlier by someone else";
  ASSERT_EQ(::write(fd.get(), before.data(), before.size()),
            static_cast<ssize_t>(before.size()));
  std::string expected = before;
  {
    CheckpointFileWriter writer(fd.get(), path_);
    EXPECT_FALSE(writer.direct()) << "an unaligned offset cannot be written direct";
    for (uint64_t n : kPieces) {
      const std::string piece = RandomBytes(n, static_cast<uint32_t>(n));
      ASSERT_TRUE(writer.Write(piece.data(), piece.size()).ok());
      expected += piece;
    }
    ASSERT_TRUE(writer.Finish().ok());
  }
  EXPECT_TRUE(Read() == expected);
}

TEST_F(CheckpointFileWriterTest, NothingWrittenMakesAnEmptyFile) {
  ipc::UniqueFd fd = Create();
  ASSERT_TRUE(fd.valid());
  CheckpointFileWriter writer(fd.get(), path_);
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_EQ(Read().size(), 0u);
}

TEST_F(CheckpointFileWriterTest, AFailedWriteSaysWhichFile) {
  // Read-only: every write fails, direct or not, and the error must name the file.
  ipc::UniqueFd fd(::open(::testing::TempDir().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  CheckpointFileWriter writer(fd.get(), "the-checkpoint");
  const std::string bytes(9u << 20, 'x');
  const absl::Status status = writer.Write(bytes.data(), bytes.size());
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("the-checkpoint"), std::string::npos) << status;
}

}  // namespace
}  // namespace trainstream::daemon
