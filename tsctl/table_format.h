// SPDX-License-Identifier: Apache-2.0
// Plain-text output for tsctl: aligned columns and human-readable quantities.
#ifndef TRAINSTREAM_TSCTL_TABLE_FORMAT_H_
#define TRAINSTREAM_TSCTL_TABLE_FORMAT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainstream::tsctl {

enum class Align { kLeft, kRight };

struct Column {
  std::string header;
  Align align = Align::kLeft;
};

// Rows of cells printed as columns two spaces apart, each as wide as its widest cell, under a
// header line. Not thread-safe; build one per output.
class Table {
 public:
  explicit Table(std::vector<Column> columns);

  // Missing cells print empty; cells beyond the columns are dropped.
  void AddRow(std::vector<std::string> cells);

  bool empty() const { return rows_.empty(); }

  // The header and rows, each line ending in '\n', with no trailing spaces.
  std::string Render() const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// "label:  value" lines with the values aligned after the longest label.
std::string RenderFields(const std::vector<std::pair<std::string, std::string>>& fields);

// 1536 -> "1.5 KiB", 1 << 30 -> "1 GiB", 100 -> "100 B": binary units, one decimal unless whole.
std::string HumanBytes(uint64_t bytes);

// 4.2 -> "4.2s", 75 -> "1m15s", 7300 -> "2h01m", 200000 -> "2d07h"; negative reads as 0.
std::string HumanDuration(double seconds);

}  // namespace trainstream::tsctl

#endif  // TRAINSTREAM_TSCTL_TABLE_FORMAT_H_
