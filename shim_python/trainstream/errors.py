# SPDX-License-Identifier: Apache-2.0
"""Exceptions raised by trainstream. Each daemon error code has its own class; all derive from
:class:`TrainStreamError`, and each also derives from the built-in exception a Python user would
catch for it (``ValueError`` for bad arguments, ``MemoryError`` for exhausted memory, ...)."""


class TrainStreamError(Exception):
    """Base class of every trainstream error."""


class InvalidArgumentError(TrainStreamError, ValueError):
    """The request was malformed: a bad size, name, offset or option."""


class NotFoundError(TrainStreamError, LookupError):
    """No such session, buffer or segment (it ended, or never existed)."""


class AlreadyExistsError(TrainStreamError, FileExistsError):
    """The name is taken (for example a buffer name within a job)."""


class PermissionDeniedError(TrainStreamError, PermissionError):
    """The object belongs to another user or session."""


class ResourceExhaustedError(TrainStreamError, MemoryError):
    """The daemon's memory budget, a quota or a ring is full."""


class FailedPreconditionError(TrainStreamError, RuntimeError):
    """The operation does not fit the object's state (for example sealing a mapped buffer)."""


class DaemonUnavailableError(TrainStreamError, ConnectionError):
    """No daemon answers on the socket, or it stopped."""


class DeadlineExceededError(TrainStreamError, TimeoutError):
    """The daemon did not answer in time."""


class InternalError(TrainStreamError, RuntimeError):
    """A fault inside trainstream; please report it."""


_BY_CODE = {
    3: InvalidArgumentError,
    4: DeadlineExceededError,
    5: NotFoundError,
    6: AlreadyExistsError,
    7: PermissionDeniedError,
    8: ResourceExhaustedError,
    9: FailedPreconditionError,
    11: InvalidArgumentError,  # OUT_OF_RANGE
    14: DaemonUnavailableError,
    16: PermissionDeniedError,  # UNAUTHENTICATED
}


def exception_for_code(code: int) -> type:
    """The exception class for an absl/gRPC status code (used by the C++ module)."""
    return _BY_CODE.get(code, InternalError)
