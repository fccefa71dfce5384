# SPDX-License-Identifier: Apache-2.0
"""CUDA as the package uses it: whether the native module can, the device's identity the
daemon knows it by, batched copies, and the current stream read cheaply.

The current stream is read for hooks that run hundreds of times a step.

``torch.cuda.current_stream(device)`` normalises its device argument and builds a new
``Stream`` object at every call. A LoRA step over a streamed 14B base asked for it about 1,650
times, and cProfile put those calls at a tenth of the step's CPU time (``bench/README.md``).
Here the stream's ids are read directly and one ``Stream`` object is kept per stream.
"""

from __future__ import annotations

import torch

from .. import _trainstream

# Absent from a torch built without CUDA, where nothing here is called.
_current_ids = getattr(torch._C, "_cuda_getCurrentStream", None)  # (id, device index, type)
_current_pointer = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # cudaStream_t as int
_streams: dict[tuple, torch.cuda.Stream] = {}
# Pool streams are never destroyed, but a caller's external streams come and go: a bound on
# the cache keeps them from piling up.
_MAX_CACHED = 256


def device_index(device: torch.device) -> int:
    """``device``'s index, the current device's for a bare ``"cuda"``."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current(index: int) -> torch.cuda.Stream:
    """The current stream of CUDA device ``index`` (as ``torch.cuda.current_stream``)."""
    ids = _current_ids(index)
    stream = _streams.get(ids)
    if stream is None:
        if len(_streams) >= _MAX_CACHED:
            _streams.clear()
        stream = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
        _streams[ids] = stream
    return stream


def current_pointer(index: int) -> int:
    """The current stream of CUDA device ``index`` as a ``cudaStream_t`` (for native calls)."""
    return _current_pointer(index)


def cuda_available() -> tuple[bool, str]:
    """Whether the client library can use a GPU, and why not when it cannot."""
    return _trainstream.cuda_available()


def device_uuid(index: int) -> str:
    """CUDA device ``index``'s UUID: how the daemon names a GPU across processes, whose device
    numbering may differ (CUDA_VISIBLE_DEVICES)."""
    return _trainstream.cuda_device_uuid(index)


def copy_pieces(stream_pointer: int, pieces: list) -> None:
    """Queues each (destination, source, bytes) pointer copy, host to device or back, on
    ``stream_pointer`` in one native call instead of a torch call a piece."""
    _trainstream.copy_pieces(stream_pointer, pieces)
