// SPDX-License-Identifier: Apache-2.0
#include "rpc/connection_credentials.h"

#include "absl/strings/str_cat.h"

namespace trainstream::daemon {

void ConnectionCredentials::Record(int fd, const PeerCredentials& peer) {
  absl::MutexLock lock(&mu_);
  by_peer_[absl::StrCat("fd:", fd)] = peer;
}

std::optional<PeerCredentials> ConnectionCredentials::Find(const std::string& grpc_peer) const {
  absl::MutexLock lock(&mu_);
  auto it = by_peer_.find(grpc_peer);
  if (it == by_peer_.end()) return std::nullopt;
  return it->second;
}

}  // namespace trainstream::daemon
