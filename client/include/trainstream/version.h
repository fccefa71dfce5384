// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_VERSION_H_
#define TRAINSTREAM_VERSION_H_

namespace trainstream {
inline constexpr char kTrainStreamVersion[] = "0.1.0";
}

#endif  // TRAINSTREAM_VERSION_H_
