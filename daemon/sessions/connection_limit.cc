// SPDX-License-Identifier: Apache-2.0
#include "sessions/connection_limit.h"

#include <sys/stat.h>

#include <algorithm>

namespace trainstream::daemon {
namespace {

bool Identify(int fd, ino_t* inode, dev_t* device) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  *inode = st.st_ino;
  *device = st.st_dev;
  return true;
}

}  // namespace

void ConnectionLimit::DropClosedLocked(std::vector<Open>& open) {
  open.erase(std::remove_if(open.begin(), open.end(),
                            [](const Open& o) {
                              ino_t inode;
                              dev_t device;
                              // Closed, or the number reused by another file since.
                              return !Identify(o.fd, &inode, &device) || inode != o.inode ||
                                     device != o.device;
                            }),
             open.end());
}

bool ConnectionLimit::Admit(const PeerCredentials& peer, int fd) {
  Open entry{fd, 0, 0};
  if (!Identify(fd, &entry.inode, &entry.device)) return false;
  absl::MutexLock lock(&mu_);
  std::vector<Open>& open = by_uid_[peer.uid];
  if (per_uid_ != 0 && !peer.admin && open.size() >= per_uid_) {
    DropClosedLocked(open);
    if (open.size() >= per_uid_) return false;
  }
  open.push_back(entry);
  return true;
}

void ConnectionLimit::Release(int fd) {
  ino_t inode = 0;
  dev_t device = 0;
  if (!Identify(fd, &inode, &device)) return;  // gone already: dropped at the next count
  absl::MutexLock lock(&mu_);
  for (auto& [uid, open] : by_uid_) {
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
      return o.fd == fd && o.inode == inode && o.device == device;
    });
    if (it != open.end()) {
      open.erase(it);
      return;
    }
  }
}

size_t ConnectionLimit::OpenFor(uid_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = by_uid_.find(uid);
  if (it == by_uid_.end()) return 0;
  DropClosedLocked(it->second);
  return it->second.size();
}

}  // namespace trainstream::daemon
