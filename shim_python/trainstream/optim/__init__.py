# SPDX-License-Identifier: Apache-2.0
"""The optimizer side: ``OffloadAdamW``, the torch.optim facade over the daemon's host optimizer,
and what updates run on the GPU instead (staged moments, the non-finite guard)."""
