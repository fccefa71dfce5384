# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's knobs of the daemon's pass that TrainStream 0.6 had, checked before the
daemon is asked (it checks them again): ``threads`` (at most this many of the daemon's AdamW
workers run this job's pass at once; default all), ``chunk_elems`` (elements per task of that
pass, a multiple of 256 from 4096; default the daemon's 262144), ``eager`` (``None``: each
tensor's update starts as its last gradient lands; where clipping or ``nonfinite='skip'`` /
``'error'`` decide the step, speculatively, after a step that needed no clipping, rolled back
exactly when the step's norm says so, and otherwise after the last gradient; ``True``:
speculate on every step; ``False``: updates always wait for every gradient) and
``pin_moments`` (``None`` or ``True``: the daemon's memory is page-locked for every job)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError


def check_pass_options(threads: Any, chunk_elems: Any, eager: Any, pin_moments: Any) -> None:
    """TrainStream 0.6's knobs of the host pass, checked before the daemon is asked."""
    for name, value in (("threads", threads), ("chunk_elems", chunk_elems)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise InvalidArgumentError(
                f"OffloadAdamW: {name}={value!r} must be None or an integer >= 1")
    if eager not in (None, True, False):
        raise InvalidArgumentError(f"OffloadAdamW: eager={eager!r} must be None, True or False")
    if pin_moments not in (None, True):
        raise InvalidArgumentError(
            f"OffloadAdamW: pin_moments={pin_moments!r}: the moments live in trainstreamd's "
            "memory, page-locked for every job and bounded by its --memory_budget; there is "
            "no pageable copy to choose (leave it None)")
