// SPDX-License-Identifier: Apache-2.0
#include "sessions/granted_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "safetensors/checkpoint_set.h"
#include "safetensors/test_checkpoints.h"

namespace trainstream::daemon {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class GrantedFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("granted-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  std::string Write(const std::string& name, const std::string& text) {
    std::ofstream(Path(name)) << text;
    return Path(name);
  }
  static ipc::UniqueFd Open(const std::string& path, int flags) {
    ipc::UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC));
    EXPECT_TRUE(fd.valid()) << path;
    return fd;
  }
  static std::vector<ipc::UniqueFd> Fds(ipc::UniqueFd a) {
    std::vector<ipc::UniqueFd> fds;
    fds.push_back(std::move(a));
    return fds;
  }

  fs::path dir_;
};

TEST_F(GrantedFilesTest, AGrantIsTakenOnceByItsOwnSession) {
  GrantedFiles granted;
  const std::string a = Write("a.bin", "hello"), b = Write("b.bin", "");
  std::vector<ipc::UniqueFd> fds;
  fds.push_back(Open(a, O_RDONLY));
  fds.push_back(Open(b, O_WRONLY));
  absl::StatusOr<uint64_t> id = granted.Add("s1", 0, {a, b}, std::move(fds));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(granted.held_files(), 2u);

  EXPECT_EQ(granted.Take("s2", *id).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<FileGrant> taken = granted.Take("s1", *id);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(granted.held_files(), 0u);
  EXPECT_TRUE(taken->files().at(a).readable);
  EXPECT_FALSE(taken->files().at(a).writable);
  EXPECT_TRUE(taken->files().at(b).writable);
  EXPECT_FALSE(taken->files().at(b).readable);
  EXPECT_THAT(std::string(granted.Take("s1", *id).status().message()),
              HasSubstr("each grant serves one request"));

  uint64_t bytes = 0;
  absl::StatusOr<ipc::UniqueFd> read = taken->OpenForReading(a, &bytes);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(bytes, 5u);
  char text[5];
  EXPECT_EQ(::pread(read->get(), text, 5, 0), 5);
  EXPECT_EQ(std::string(text, 5), "hello");
  EXPECT_EQ(taken->OpenForReading(b, &bytes).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(taken->OpenForReading(Path("c.bin"), &bytes).status().message()),
              HasSubstr("is not among the 2 files the client opened"));
}

TEST_F(GrantedFilesTest, AGrantGrowsMessageByMessageAndNamesFormAFolder) {
  GrantedFiles granted;
  const std::string a = Write("a.bin", "1"), b = Write("b.bin", "2");
  absl::StatusOr<uint64_t> id = granted.Add("s", 0, {a}, Fds(Open(a, O_RDONLY)));
  ASSERT_TRUE(id.ok());
  ASSERT_EQ(*granted.Add("s", *id, {b}, Fds(Open(b, O_RDWR))), *id);
  // Another session may not add to it, nor may a file be named twice.
  EXPECT_EQ(granted.Add("t", *id, {b}, Fds(Open(b, O_RDONLY))).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(granted.Add("s", *id, {b}, Fds(Open(b, O_RDONLY))).status().message()),
              HasSubstr("already"));
  absl::StatusOr<FileGrant> taken = granted.Take("s", *id);
  ASSERT_TRUE(taken.ok());
  EXPECT_EQ(taken->files().size(), 2u);
  EXPECT_TRUE(taken->IsDirectory(dir_.string()));
  EXPECT_TRUE(taken->Exists(dir_.string()));
  EXPECT_FALSE(taken->IsDirectory(a));
  EXPECT_TRUE(taken->Exists(a));
  EXPECT_FALSE(taken->Exists(Path("a")));  // a prefix of a name is not a folder
  EXPECT_EQ(*taken->RealPath(a), a);
  EXPECT_EQ(taken->RealPath(Path("c.bin")).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(GrantedFilesTest, RefusesWhatIsNotAFileOfItsName) {
  GrantedFiles granted;
  const std::string a = Write("a.bin", "1");
  auto refused = [&](std::vector<std::string> names, std::vector<ipc::UniqueFd> fds) {
    absl::StatusOr<uint64_t> id = granted.Add("s", 0, names, std::move(fds));
    EXPECT_FALSE(id.ok());
    return id.ok() ? std::string() : std::string(id.status().message());
  };
  EXPECT_THAT(refused({"a.bin"}, Fds(Open(a, O_RDONLY))), HasSubstr("not an absolute path"));
  EXPECT_THAT(refused({dir_.string() + "/../a.bin"}, Fds(Open(a, O_RDONLY))),
              HasSubstr("not an absolute path"));
  EXPECT_THAT(refused({dir_.string() + "//a.bin"}, Fds(Open(a, O_RDONLY))),
              HasSubstr("not an absolute path"));
  EXPECT_THAT(refused({a, a}, [&] {
                std::vector<ipc::UniqueFd> two;
                two.push_back(Open(a, O_RDONLY));
                two.push_back(Open(a, O_RDONLY));
                return two;
              }()),
              HasSubstr("named twice"));
  EXPECT_THAT(refused({a}, {}), HasSubstr("names 1 files and carries 0 descriptors"));
  EXPECT_THAT(refused({}, {}), HasSubstr("names no file"));
  EXPECT_THAT(refused({dir_.string()}, Fds(Open(dir_.string(), O_RDONLY | O_DIRECTORY))),
              HasSubstr("not of a regular file"));
  EXPECT_THAT(refused({a}, Fds(Open(a, O_PATH))), HasSubstr("O_PATH"));
  // A refused message adds nothing, not even the files that were right.
  EXPECT_THAT(refused({a, dir_.string()}, [&] {
                std::vector<ipc::UniqueFd> two;
                two.push_back(Open(a, O_RDONLY));
                two.push_back(Open(dir_.string(), O_RDONLY | O_DIRECTORY));
                return two;
              }()),
              HasSubstr("not of a regular file"));
  EXPECT_EQ(granted.held_files(), 0u);
}

TEST_F(GrantedFilesTest, ASessionHoldsABoundedNumberAndItsEndClosesThem) {
  GrantedFiles granted(/*max_files_per_session=*/3, /*max_files=*/4);
  const std::string a = Write("a.bin", "1");
  auto add = [&](const std::string& session, int n) {
    std::vector<std::string> names;
    std::vector<ipc::UniqueFd> fds;
    for (int i = 0; i < n; ++i) {
      names.push_back(Path("f" + std::to_string(i)));
      fds.push_back(Open(a, O_RDONLY));
    }
    return granted.Add(session, 0, names, std::move(fds));
  };
  ASSERT_TRUE(add("s", 3).ok());
  absl::StatusOr<uint64_t> over = add("s", 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("may hand over 3 at a time"));
  ASSERT_TRUE(add("t", 1).ok());
  EXPECT_EQ(add("u", 1).status().code(), absl::StatusCode::kResourceExhausted);  // 4 in all
  granted.SessionEnded("s");
  EXPECT_EQ(granted.held_files(), 1u);
  EXPECT_TRUE(add("u", 1).ok());
}

TEST_F(GrantedFilesTest, ACheckpointReadsFromTheGrantAlone) {
  using test_checkpoints::Entry;
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<Entry> one = {{"a.weight", "F32", {4}, test_checkpoints::Bytes(x)}};
  const std::vector<Entry> two = {{"b.weight", "F32", {4}, test_checkpoints::Bytes(x)}};
  test_checkpoints::WriteFile(Path("model-1.safetensors"), one);
  test_checkpoints::WriteFile(Path("model-2.safetensors"), two);
  const std::string index = Write(
      "model.safetensors.index.json",
      R"({"weight_map":{"a.weight":"model-1.safetensors","b.weight":"model-2.safetensors"}})");
  auto grant_of = [&](const std::vector<std::string>& files) {
    GrantedFiles granted;
    std::vector<std::string> names;
    std::vector<ipc::UniqueFd> fds;
    for (const std::string& f : files) {
      names.push_back(Path(f));
      fds.push_back(Open(Path(f), O_RDONLY));
    }
    const uint64_t id = *granted.Add("s", 0, names, std::move(fds));
    return *granted.Take("s", id);
  };
  FileGrant whole = grant_of({"model.safetensors.index.json", "model-1.safetensors",
                              "model-2.safetensors"});
  // The folder, as the daemon would see it, goes away: the grant's descriptors still read.
  const fs::path moved = dir_.string() + "-moved";
  fs::rename(dir_, moved);
  absl::StatusOr<CheckpointSet> set = CheckpointSet::Open(dir_.string(), whole);
  fs::rename(moved, dir_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->tensors().size(), 2u);
  EXPECT_EQ(set->index_path(), index);

  FileGrant partial = grant_of({"model.safetensors.index.json", "model-1.safetensors"});
  absl::StatusOr<CheckpointSet> missing = CheckpointSet::Open(index, partial);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("model-2.safetensors is not among the 2 files the client opened"));
}

}  // namespace
}  // namespace trainstream::daemon
