// SPDX-License-Identifier: Apache-2.0
#include "table_format.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainstream::tsctl {

Table::Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> widths(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    widths[c] = columns_[c].header.size();
    for (const auto& row : rows_) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  auto append_line = [&](const auto& cell_at) {
    std::string line;
    for (size_t c = 0; c < columns_.size(); ++c) {
      const std::string& cell = cell_at(c);
      const std::string pad(widths[c] - cell.size(), ' ');
      if (c > 0) line += "  ";
      if (columns_[c].align == Align::kRight) {
        absl::StrAppend(&line, pad, cell);
      } else {
        absl::StrAppend(&line, cell, pad);
      }
    }
    // Left-aligned last columns would otherwise leave padding at the end of the line.
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, line, "\n");
  };
  append_line([&](size_t c) -> const std::string& { return columns_[c].header; });
  for (const auto& row : rows_) {
    append_line([&](size_t c) -> const std::string& { return row[c]; });
  }
  return out;
}

std::string RenderFields(const std::vector<std::pair<std::string, std::string>>& fields) {
  size_t width = 0;
  for (const auto& [label, value] : fields) width = std::max(width, label.size() + 1);
  std::string out;
  for (const auto& [label, value] : fields) {
    absl::StrAppend(&out, absl::StrFormat("%-*s  %s\n", width, label + ":", value));
  }
  return out;
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  size_t unit = 0;
  double value = static_cast<double>(bytes);
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  // Rounding to one decimal can reach 1024.0 ("1024.0 KiB"): carry into the next unit.
  if (std::round(value * 10) / 10 >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  const double tenths = std::round(value * 10);
  if (std::fmod(tenths, 10) == 0) return absl::StrFormat("%.0f %s", tenths / 10, kUnits[unit]);
  return absl::StrFormat("%.1f %s", tenths / 10, kUnits[unit]);
}

std::string HumanDuration(double seconds) {
  if (!(seconds > 0)) seconds = 0;  // also catches NaN
  if (seconds < 59.95) return absl::StrFormat("%.1fs", seconds);
  const uint64_t s = static_cast<uint64_t>(seconds);
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, s % 3600 / 60);
  return absl::StrFormat("%dd%02dh", s / 86400, s % 86400 / 3600);
}

}  // namespace trainstream::tsctl
