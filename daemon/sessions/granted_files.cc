// SPDX-License-Identifier: Apache-2.0
#include "sessions/granted_files.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kMaxNameBytes = 4096;

// Absolute, with no empty, "." or ".." component: the form realpath() gives, so that a name
// compares equal to the one a checkpoint's index leads to.
bool IsNormalizedAbsolute(const std::string& name) {
  if (name.size() < 2 || name.size() > kMaxNameBytes || name[0] != '/' || name.back() == '/' ||
      name.find('\0') != std::string::npos) {
    return false;
  }
  for (size_t start = 1; start <= name.size();) {
    size_t end = name.find('/', start);
    if (end == std::string::npos) end = name.size();
    const std::string_view part(name.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

absl::StatusOr<GrantedFile> Check(const std::string& name, ipc::UniqueFd fd) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the descriptor for %s: %s", name, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the descriptor for %s is not of a regular file", name));
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || (flags & O_PATH) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the descriptor for %s was opened with O_PATH; open the file for reading or writing",
        name));
  }
  GrantedFile file;
  file.readable = (flags & O_ACCMODE) == O_RDONLY || (flags & O_ACCMODE) == O_RDWR;
  file.writable = (flags & O_ACCMODE) == O_WRONLY || (flags & O_ACCMODE) == O_RDWR;
  file.fd = std::move(fd);
  return file;
}

}  // namespace

absl::StatusOr<ipc::UniqueFd> FileGrant::OpenForReading(const std::string& path,
                                                        uint64_t* bytes) const {
  const auto it = files_.find(path);
  if (it == files_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "%s is not among the %d files the client opened and handed over (could it read it?)",
        path, files_.size()));
  }
  if (!it->second.readable) {
    return absl::PermissionDeniedError(
        absl::StrFormat("%s was handed over for writing only", path));
  }
  // A descriptor of its own: the reader keeps it after the grant is gone.
  ipc::UniqueFd fd(::fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0));
  struct stat st {};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the daemon could not keep %s open: %s", path, std::strerror(errno)));
  }
  *bytes = static_cast<uint64_t>(st.st_size);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  return fd;
}

bool FileGrant::IsDirectory(const std::string& path) const {
  const std::string prefix = path + "/";
  const auto it = files_.lower_bound(prefix);
  return it != files_.end() && absl::StartsWith(it->first, prefix);
}

bool FileGrant::Exists(const std::string& path) const {
  return files_.contains(path) || IsDirectory(path);
}

absl::StatusOr<std::string> FileGrant::RealPath(const std::string& path) const {
  if (Exists(path)) return path;
  return absl::NotFoundError(absl::StrFormat(
      "%s is not among the %d files the client opened and handed over (could it read it?)", path,
      files_.size()));
}

absl::StatusOr<uint64_t> GrantedFiles::Add(const std::string& session_id, uint64_t grant,
                                           const std::vector<std::string>& names,
                                           std::vector<ipc::UniqueFd> fds) {
  if (names.size() != fds.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a grant of files names %d files and carries %d descriptors", names.size(), fds.size()));
  }
  if (names.empty()) return absl::InvalidArgumentError("a grant of files names no file");
  std::vector<std::pair<std::string, GrantedFile>> checked;
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!IsNormalizedAbsolute(names[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "'%s' is not an absolute path without '.', '..' or empty parts", names[i]));
    }
    if (!seen.insert(names[i]).second) {
      return absl::InvalidArgumentError(absl::StrFormat("%s is named twice", names[i]));
    }
    absl::StatusOr<GrantedFile> file = Check(names[i], std::move(fds[i]));
    if (!file.ok()) return file.status();
    checked.emplace_back(names[i], *std::move(file));
  }

  absl::MutexLock lock(&mu_);
  // The session's count is looked up, not made: a refused request leaves no entry behind.
  const auto counted = files_of_session_.find(session_id);
  const size_t held = counted == files_of_session_.end() ? 0 : counted->second;
  if (held + checked.size() > max_files_per_session_ || files_ + checked.size() > max_files_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the daemon holds %d files handed over by this session and %d in all; a session may "
        "hand over %d at a time (a request uses its grant up)",
        held, files_, max_files_per_session_));
  }
  if (grant != 0) {
    const auto it = grants_.find(grant);
    if (it == grants_.end() || it->second.session_id != session_id) {
      return absl::NotFoundError(absl::StrFormat("this session has no grant of files %d", grant));
    }
    for (const auto& [name, file] : checked) {
      if (it->second.grant.files_.contains(name)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s is in grant %d already", name, grant));
      }
    }
  }
  const uint64_t id = grant != 0 ? grant : next_id_++;
  Pending& pending = grants_[id];
  pending.session_id = session_id;
  for (auto& [name, file] : checked) pending.grant.files_.emplace(name, std::move(file));
  files_of_session_[session_id] = held + checked.size();
  files_ += checked.size();
  return id;
}

absl::StatusOr<FileGrant> GrantedFiles::Take(const std::string& session_id, uint64_t grant) {
  absl::MutexLock lock(&mu_);
  const auto it = grants_.find(grant);
  if (it == grants_.end() || it->second.session_id != session_id) {
    return absl::NotFoundError(absl::StrFormat(
        "this session has no grant of files %d (each grant serves one request)", grant));
  }
  FileGrant taken = std::move(it->second.grant);
  grants_.erase(it);
  files_ -= taken.files().size();
  const auto held = files_of_session_.find(session_id);
  if (held != files_of_session_.end()) {
    held->second -= taken.files().size();
    if (held->second == 0) files_of_session_.erase(held);
  }
  return taken;
}

void GrantedFiles::SessionEnded(const std::string& session_id) {
  std::vector<FileGrant> closing;  // closed outside the lock
  absl::MutexLock lock(&mu_);
  for (auto it = grants_.begin(); it != grants_.end();) {
    if (it->second.session_id == session_id) {
      files_ -= it->second.grant.files().size();
      closing.push_back(std::move(it->second.grant));
      it = grants_.erase(it);
    } else {
      ++it;
    }
  }
  files_of_session_.erase(session_id);
}

size_t GrantedFiles::held_files() const {
  absl::MutexLock lock(&mu_);
  return files_;
}

}  // namespace trainstream::daemon
