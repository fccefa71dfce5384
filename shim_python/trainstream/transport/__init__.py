# SPDX-License-Identifier: Apache-2.0
"""The transport layer: the daemon's API as Python sees it (sessions, buffers in shared memory,
the host optimizer's slots, the embedded daemon) and the CUDA stream helpers the copies use.
The layers above reach the daemon only through here."""
