// SPDX-License-Identifier: Apache-2.0
// The safetensors reader on small checkpoints written here, whole and broken in each way a
// header or a file can be, and the tensor reader's conversions against the reference
// quantizers.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cpu/numeric.h"
#include "cpu/quantize.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "safetensors/checkpoint_set.h"
#include "safetensors/safetensors_file.h"
#include "safetensors/tensor_reader.h"
#include "safetensors/test_checkpoints.h"

namespace trainstream::daemon {
namespace {

namespace fs = std::filesystem;
using test_checkpoints::Bytes;
using test_checkpoints::Entry;
using test_checkpoints::FloatEntry;
using test_checkpoints::Normal;
using test_checkpoints::WriteFile;
using ::testing::HasSubstr;
using ::testing::Not;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("ts-safetensors-", ::getpid(), "-",
                                                    ::testing::UnitTest::GetInstance()
                                                        ->current_test_info()
                                                        ->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(SafetensorsTest, OpensAFileAndListsItsTensorsInByteOrder) {
  std::vector<float> exact;
  WriteFile(Path("m.safetensors"),
            {FloatEntry("b.weight", "BF16", Normal(6, 1), &exact),
             {"a.ids", "I64", {2}, Bytes(std::vector<int64_t>{7, 8})}});
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(Path("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->tensors()[0].name, "b.weight");  // first in the file, though not by name
  EXPECT_EQ(f->tensors()[0].numel, 6u);
  EXPECT_EQ(f->tensors()[1].dtype, "I64");
  EXPECT_EQ(f->tensors()[1].shape, (std::vector<uint64_t>{2}));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  ASSERT_NE(f->Find("a.ids"), nullptr);
  int64_t ids[2];
  ASSERT_TRUE(f->Read(f->Find("a.ids")->offset, ids, 16).ok());
  EXPECT_EQ(ids[1], 8);
}

TEST_F(SafetensorsTest, BrokenFilesFailWithTheFileAndTensorNamed) {
  const Entry w{"w", "F32", {4}, Bytes(std::vector<float>{1, 2, 3, 4})};
  struct Case {
    std::string what, header;
    uint64_t cut;
    std::string expect;
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  } cases[] = {
      {"truncated", "", 4, "past the 12 bytes of data", absl::StatusCode::kDataLoss},
      {"bad json", "{not json", 0, "not valid JSON"},
      {"unknown dtype", R"({"w":{"dtype":"F7","shape":[4],"data_offsets":[0,16]}})", 0,
       "unknown dtype 'F7'"},
      {"shape mismatch", R"({"w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", 0,
       "16 bytes do not hold 5 F32 values"},
      {"negative dim", R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", 0,
       "not a non-negative integer"},
      {"offsets", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", 0,
       "data_offsets"},
      {"overlap",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       0, "overlap"},
      {"metadata", R"({"__metadata__":{"n":1}})", 0, "is not a string"},
  };
  for (const Case& c : cases) {
    const std::string path = Path("broken.safetensors");
    WriteFile(path, {w}, c.header, c.cut);
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.what;
    EXPECT_EQ(f.status().code(), c.code) << c.what;
    EXPECT_THAT(std::string(f.status().message()), HasSubstr(c.expect)) << c.what;
    EXPECT_THAT(std::string(f.status().message()), HasSubstr(path)) << c.what;
  }
  // A header size past the end of the file, and a file too short for one.
  std::ofstream(Path("short.safetensors"), std::ios::binary) << std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10);
  EXPECT_THAT(std::string(SafetensorsFile::Open(Path("short.safetensors")).status().message()),
              HasSubstr("the header claims 255 bytes"));
  std::ofstream(Path("tiny.safetensors"), std::ios::binary) << "abc";
  EXPECT_EQ(SafetensorsFile::Open(Path("tiny.safetensors")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsFile::Open(Path("absent.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, AHeaderNestedDeepIsRefusedBeforeItIsParsed) {
  // 30,000 levels in 60 KB once took the JSON parser 21 s of CPU. Brackets inside a string
  // are text, not nesting.
  const Entry w{"w", "F32", {4}, Bytes(std::vector<float>{1, 2, 3, 4})};
  const std::string deep = "{\"__metadata__\":{\"x\":\"[[[[\"},\"junk\":" +
                           std::string(30000, '[') + std::string(30000, ']') + "}";
  const std::string path = Path("deep.safetensors");
  WriteFile(path, {w}, deep, 0);
  const absl::Time start = absl::Now();
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("nests 30001 levels deep"));
  // Sixteen levels, the most allowed, still reach the parser (which says what else is wrong).
  WriteFile(path, {w}, "{\"junk\":" + std::string(15, '[') + std::string(15, ']') + "}", 0);
  EXPECT_THAT(std::string(SafetensorsFile::Open(path).status().message()),
              Not(HasSubstr("levels deep")));
}

TEST_F(SafetensorsTest, OnlyRegularFilesAreReadAndOverlapsPastAnEmptyTensorAreFound) {
  // A FIFO would block an open and never end a read: refused at once.
  ASSERT_EQ(::mkfifo(Path("fifo.safetensors").c_str(), 0600), 0);
  EXPECT_THAT(std::string(SafetensorsFile::Open(Path("fifo.safetensors")).status().message()),
              HasSubstr("is not a regular file"));
  fs::create_symlink("/dev/zero", Path("model.safetensors.index.json"));
  EXPECT_THAT(std::string(CheckpointSet::Open(dir_.string()).status().message()),
              HasSubstr("is not a regular file"));
  // [0, 16) and [8, 12) overlap though an empty tensor sits between them in offset order.
  WriteFile(Path("o.safetensors"), {{"w", "F32", {4}, Bytes(std::vector<float>{1, 2, 3, 4})}},
            R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
            R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
            R"("v":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})");
  EXPECT_THAT(std::string(SafetensorsFile::Open(Path("o.safetensors")).status().message()),
              HasSubstr("'w' and 'v' overlap"));
}

TEST_F(SafetensorsTest, ShardedCheckpointsAreCheckedAgainstTheirIndex) {
  std::vector<float> exact;
  WriteFile(Path("model-00001-of-00002.safetensors"),
            {FloatEntry("layers.0.w", "BF16", Normal(8, 2), &exact)});
  WriteFile(Path("model-00002-of-00002.safetensors"),
            {FloatEntry("layers.1.w", "BF16", Normal(8, 3), &exact),
             FloatEntry("norm.w", "F32", Normal(4, 4), &exact)});
  auto write_index = [&](const std::string& map) {
    std::ofstream(Path("model.safetensors.index.json"))
        << R"({"metadata":{"total_size":80},"weight_map":{)" << map << "}}";
  };
  write_index(R"("layers.0.w":"model-00001-of-00002.safetensors",)"
              R"("layers.1.w":"model-00002-of-00002.safetensors",)"
              R"("norm.w":"model-00002-of-00002.safetensors")");
  absl::StatusOr<CheckpointSet> set = CheckpointSet::Open(dir_.string());  // the folder
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->files().size(), 2u);
  ASSERT_EQ(set->tensors().size(), 3u);
  EXPECT_EQ(set->tensor_bytes(), 16u + 16u + 16u);
  ASSERT_NE(set->Find("norm.w"), nullptr);
  EXPECT_THAT(set->Find("norm.w")->file->path(), HasSubstr("00002"));

  write_index(R"("layers.0.w":"model-00001-of-00002.safetensors",)"
              R"("layers.1.w":"model-00002-of-00002.safetensors")");
  EXPECT_THAT(std::string(CheckpointSet::Open(Path("model.safetensors.index.json"))
                              .status()
                              .message()),
              HasSubstr("holds tensor 'norm.w', which the index does not list"));
  write_index(R"("layers.0.w":"model-00001-of-00002.safetensors",)"
              R"("layers.1.w":"model-00001-of-00002.safetensors",)"
              R"("norm.w":"model-00002-of-00002.safetensors")");
  EXPECT_THAT(std::string(CheckpointSet::Open(dir_.string()).status().message()),
              HasSubstr("'layers.1.w', which the index places in model-00001-of-00002"));
  write_index(R"("layers.0.w":"../elsewhere.safetensors")");
  EXPECT_THAT(std::string(CheckpointSet::Open(dir_.string()).status().message()),
              HasSubstr("is not a file name"));
  write_index(R"("layers.0.w":"model-00003-of-00002.safetensors")");
  EXPECT_EQ(CheckpointSet::Open(dir_.string()).status().code(), absl::StatusCode::kNotFound);
  fs::remove(Path("model.safetensors.index.json"));
  EXPECT_THAT(std::string(CheckpointSet::Open(dir_.string()).status().message()),
              HasSubstr("holds neither model.safetensors nor"));
}

TEST_F(SafetensorsTest, TensorsAreReadWindowByWindowExactlyAsTheReferenceConverts) {
  const std::vector<float> x = Normal(1000, 5);
  for (const char* dtype : {"F32", "F16", "BF16", "F64"}) {
    std::vector<float> exact;
    const std::string path = Path("t.safetensors");
    WriteFile(path, {FloatEntry("w", dtype, x, &exact)});
    SafetensorsFile f = *SafetensorsFile::Open(path);
    const SafetensorsTensor& t = f.tensors()[0];
    // bf16: each value rounded once from what the file holds.
    StoredLayout bf16 = *StoredLayoutFor(t, StoredAs::kBFloat16);
    std::vector<uint8_t> data(bf16.data_bytes);
    std::vector<uint64_t> seen;
    ASSERT_TRUE(ReadTensor(f, t, bf16, data.data(), nullptr,
                           [&](uint64_t b) { seen.push_back(b); }, 100)
                    .ok());
    for (size_t i = 0; i < x.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, data.data() + 2 * i, 2);
      ASSERT_EQ(h, kernels::FloatToBFloat16(exact[i])) << dtype << " " << i;
    }
    EXPECT_GT(seen.size(), 5u);  // many windows, each reported
    EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
    EXPECT_EQ(seen.back(), t.bytes);
    for (kernels::QuantFormat format :
         {kernels::QuantFormat::kInt8, kernels::QuantFormat::kNf4, kernels::QuantFormat::kFp8,
          kernels::QuantFormat::kNvfp4}) {
      StoredLayout q = *StoredLayoutFor(t, StoredAs::kQuantized, format);
      std::vector<uint8_t> qd(q.data_bytes), qs(q.scale_bytes);
      std::vector<uint64_t> progress;
      absl::StatusOr<ReadResult> r = ReadTensor(f, t, q, qd.data(), qs.data(),
                                                [&](uint64_t b) { progress.push_back(b); }, 256);
      ASSERT_TRUE(r.ok()) << r.status();
      // Every pass over the file counted, as the base store's total counts them: nvfp4's two.
      EXPECT_TRUE(std::is_sorted(progress.begin(), progress.end()));
      EXPECT_EQ(progress.back(),
                t.bytes * (format == kernels::QuantFormat::kNvfp4 ? 2 : 1))
          << kernels::QuantFormatName(format);
      // The reference, in one piece from the exact values.
      std::vector<uint8_t> rd(q.data_bytes), rs(q.scale_bytes);
      float amax = 0;
      for (float v : exact) amax = std::max(amax, std::fabs(v));
      const float tensor_scale = format == kernels::QuantFormat::kNvfp4
                                     ? kernels::NvFp4TensorScale(amax)
                                     : 1.0f;
      ASSERT_TRUE(kernels::Quantize(q.quant, 0, exact.data(), exact.size(), tensor_scale,
                                    rd.data(), rs.data())
                      .ok());
      EXPECT_EQ(r->tensor_scale, tensor_scale);
      EXPECT_EQ(qd, rd) << dtype << " " << kernels::QuantFormatName(format);
      EXPECT_EQ(qs, rs) << dtype << " " << kernels::QuantFormatName(format);
    }
  }
}

TEST_F(SafetensorsTest, IntegerTensorsAreKeptAsTheyAreAndNotQuantized) {
  WriteFile(Path("i.safetensors"), {{"ids", "I64", {3}, Bytes(std::vector<int64_t>{1, 2, 3})}});
  SafetensorsFile f = *SafetensorsFile::Open(Path("i.safetensors"));
  const SafetensorsTensor& t = f.tensors()[0];
  EXPECT_EQ(StoredLayoutFor(t, StoredAs::kQuantized, kernels::QuantFormat::kNf4).status().code(),
            absl::StatusCode::kInvalidArgument);
  StoredLayout as_is = *StoredLayoutFor(t, StoredAs::kAsIs);
  std::vector<int64_t> out(3);
  ASSERT_TRUE(ReadTensor(f, t, as_is, reinterpret_cast<uint8_t*>(out.data()), nullptr).ok());
  EXPECT_EQ(out, (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(SafetensorsTest, ANonFiniteWeightFailsItsQuantizationWithTheTensorNamed) {
  std::vector<float> x = Normal(128, 6);
  x[70] = std::nanf("");
  std::vector<float> exact;
  WriteFile(Path("n.safetensors"), {FloatEntry("layers.3.w", "F32", x, &exact)});
  SafetensorsFile f = *SafetensorsFile::Open(Path("n.safetensors"));
  StoredLayout q = *StoredLayoutFor(f.tensors()[0], StoredAs::kQuantized,
                                    kernels::QuantFormat::kInt8);
  std::vector<uint8_t> d(q.data_bytes), s(q.scale_bytes);
  absl::StatusOr<ReadResult> r = ReadTensor(f, f.tensors()[0], q, d.data(), s.data());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("tensor 'layers.3.w'"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("value 70"));
}

}  // namespace
}  // namespace trainstream::daemon
