// SPDX-License-Identifier: Apache-2.0
#include "doorbell/doorbell_dispatcher.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

#include "ipc/event_signal.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {
constexpr uint64_t kStopKey = 0;
constexpr uint64_t kInvalidArgumentCode = 3;
constexpr int kMaxMessagesPerWake = 4096;  // one busy client cannot starve the others
}  // namespace

absl::StatusOr<std::unique_ptr<DoorbellDispatcher>> DoorbellDispatcher::Create(
    ProtocolErrorCallback on_protocol_error) {
  ipc::UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll.valid()) return ErrnoStatus(errno, "epoll_create1");
  ipc::UniqueFd stop(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!stop.valid()) return ErrnoStatus(errno, "eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kStopKey;
  if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, stop.get(), &ev) != 0) {
    return ErrnoStatus(errno, "epoll_ctl");
  }
  return std::unique_ptr<DoorbellDispatcher>(
      new DoorbellDispatcher(std::move(on_protocol_error), std::move(epoll), std::move(stop)));
}

DoorbellDispatcher::DoorbellDispatcher(ProtocolErrorCallback on_protocol_error,
                                       ipc::UniqueFd epoll, ipc::UniqueFd stop)
    : on_protocol_error_(std::move(on_protocol_error)),
      epoll_(std::move(epoll)),
      stop_(std::move(stop)) {
  thread_ = std::thread([this] { Loop(); });
}

DoorbellDispatcher::~DoorbellDispatcher() { Stop(); }

void DoorbellDispatcher::Stop() {
  if (!thread_.joinable()) return;
  ipc::SignalEventFd(stop_.get());
  thread_.join();
}

void DoorbellDispatcher::SetHandler(ipc::DoorbellKind kind, Handler handler) {
  absl::MutexLock lock(&mu_);
  handlers_[kind] = std::move(handler);
}

absl::StatusOr<DoorbellGrant> DoorbellDispatcher::Add(std::shared_ptr<const Session> session) {
  ASSIGN_OR_RETURN(std::unique_ptr<DoorbellChannel> channel, DoorbellChannel::Create());
  ASSIGN_OR_RETURN(DoorbellGrant grant, channel->Grant());
  absl::MutexLock lock(&mu_);
  if (by_session_.contains(session->id)) {
    return absl::AlreadyExistsError("the session already has a doorbell");
  }
  uint64_t key = next_key_++;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = key;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, channel->wake_fd(), &ev) != 0) {
    return ErrnoStatus(errno, "epoll_ctl for a doorbell");
  }
  by_key_[key] = session->id;
  std::string id = session->id;
  by_session_[id] = Entry{std::move(session), std::move(channel), key};
  return grant;
}

absl::Status DoorbellDispatcher::Send(const std::string& session_id,
                                      const ipc::DoorbellMessage& message) {
  std::shared_ptr<DoorbellChannel> channel;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_session_.find(session_id);
    if (it == by_session_.end()) {
      return absl::NotFoundError("the session has no doorbell (not attached, or ended)");
    }
    channel = it->second.channel;
  }
  return channel->Send(message);
}

void DoorbellDispatcher::Remove(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_session_.find(session_id);
  if (it == by_session_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.channel->wake_fd(), nullptr);
  by_key_.erase(it->second.key);
  by_session_.erase(it);
}

void DoorbellDispatcher::Loop() {
  epoll_event events[64];
  while (true) {
    int n = ::epoll_wait(epoll_.get(), events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kStopKey) return;
      Entry entry;
      {
        absl::MutexLock lock(&mu_);
        auto key = by_key_.find(events[i].data.u64);
        if (key == by_key_.end()) continue;
        entry = by_session_.at(key->second);  // copies keep the channel alive while served
      }
      Serve(entry);
    }
  }
}

void DoorbellDispatcher::Serve(const Entry& entry) {
  entry.channel->DrainWakeups();
  for (int served = 0; served < kMaxMessagesPerWake; ++served) {
    ipc::DoorbellMessage message;
    absl::StatusOr<bool> got = entry.channel->TryReceive(&message);
    if (!got.ok()) {
      on_protocol_error_(entry.session->id, std::string(got.status().message()));
      return;
    }
    if (!*got) return;
    auto kind = static_cast<ipc::DoorbellKind>(message.kind);
    absl::Status sent;
    if (kind == ipc::DoorbellKind::kPing) {
      ipc::DoorbellMessage pong = message;
      pong.kind = static_cast<uint32_t>(ipc::DoorbellKind::kPong);
      sent = entry.channel->Send(pong);
    } else {
      Handler handler;
      {
        absl::MutexLock lock(&mu_);
        if (auto it = handlers_.find(kind); it != handlers_.end()) handler = it->second;
      }
      if (handler) {
        handler(*entry.session, message, *entry.channel);
      } else {
        sent = entry.channel->Send({static_cast<uint32_t>(ipc::DoorbellKind::kError), 0,
                                    message.id, message.step, kInvalidArgumentCode});
      }
    }
    if (!sent.ok()) {
      on_protocol_error_(entry.session->id, std::string(sent.message()));
      return;
    }
  }
  // More may be waiting: re-arm by waking ourselves so the other sessions get a turn first.
  ipc::SignalEventFd(entry.channel->wake_fd());
}

}  // namespace trainstream::daemon
