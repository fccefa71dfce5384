// SPDX-License-Identifier: Apache-2.0
// The temporary a checkpoint is written to before it is renamed over its path:
// `<path>.tmp-<pid>-<16 hex digits>` beside it, so a crash at any point leaves the previous
// checkpoint whole. The writer is the daemon (a path it opens itself) or the client (a file it
// opens with its own rights and hands to the daemon); either removes what a killed writer left.
#ifndef TRAINSTREAM_IPC_CHECKPOINT_TEMPORARIES_H_
#define TRAINSTREAM_IPC_CHECKPOINT_TEMPORARIES_H_

#include <string>

namespace trainstream::ipc {

// A fresh temporary name for a checkpoint at `path`, unique beside concurrent writers.
std::string CheckpointTemporaryName(const std::string& path);

// Removes the temporaries of `path` whose writing process is gone (up to the checkpoint's size
// each). Those of live processes, this one's included, are saves in progress and stay.
void RemoveAbandonedTemporaries(const std::string& path);

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_CHECKPOINT_TEMPORARIES_H_
