// SPDX-License-Identifier: Apache-2.0
#include "doorbell/doorbell_channel.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

absl::StatusOr<ipc::UniqueFd> Duplicate(const ipc::UniqueFd& fd) {
  ipc::UniqueFd copy(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return ErrnoStatus(errno, "duplicating a doorbell descriptor");
  return copy;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DoorbellChannel>> DoorbellChannel::Create() {
  const size_t bytes = ipc::DoorbellSegmentBytes();
  ipc::UniqueFd segment(::memfd_create("trainstream-doorbell", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!segment.valid()) return ErrnoStatus(errno, "memfd_create for a doorbell");
  if (::ftruncate(segment.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(errno, "sizing a doorbell segment");
  }
  if (int rc = ::posix_fallocate(segment.get(), 0, static_cast<off_t>(bytes)); rc != 0) {
    return ErrnoStatus(rc, "reserving a doorbell segment");
  }
  if (::fcntl(segment.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoStatus(errno, "sealing a doorbell segment's size");
  }
  ASSIGN_OR_RETURN(ipc::SharedMapping mapping,
                   ipc::SharedMapping::Map(segment.get(), bytes, /*writable=*/true));
  ipc::InitializeDoorbellSegment(mapping.data());
  ipc::UniqueFd to_daemon(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  ipc::UniqueFd to_client(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!to_daemon.valid() || !to_client.valid()) return ErrnoStatus(errno, "eventfd");
  ASSIGN_OR_RETURN(ipc::DoorbellEndpoint endpoint,
                   ipc::DoorbellEndpoint::Attach(mapping.data(), bytes, ipc::DoorbellSide::kDaemon,
                                                 to_client.get(), to_daemon.get()));
  // The daemon waits on many doorbells in one epoll set, so it always asks to be woken rather
  // than announcing each sleep.
  endpoint.BeginSleep();
  return std::unique_ptr<DoorbellChannel>(new DoorbellChannel(
      std::move(segment), std::move(mapping), std::move(to_daemon), std::move(to_client),
      std::move(endpoint)));
}

DoorbellChannel::DoorbellChannel(ipc::UniqueFd segment, ipc::SharedMapping mapping,
                                 ipc::UniqueFd to_daemon, ipc::UniqueFd to_client,
                                 ipc::DoorbellEndpoint endpoint)
    : segment_(std::move(segment)),
      mapping_(std::move(mapping)),
      to_daemon_(std::move(to_daemon)),
      to_client_(std::move(to_client)),
      endpoint_(std::move(endpoint)) {}

absl::StatusOr<DoorbellGrant> DoorbellChannel::Grant() const {
  DoorbellGrant grant;
  ASSIGN_OR_RETURN(grant.segment, Duplicate(segment_));
  ASSIGN_OR_RETURN(grant.to_daemon, Duplicate(to_daemon_));
  ASSIGN_OR_RETURN(grant.to_client, Duplicate(to_client_));
  grant.bytes = mapping_.size();
  return grant;
}

absl::Status DoorbellChannel::Send(const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&send_mu_);
  return endpoint_.Send(message);
}

}  // namespace trainstream::daemon
