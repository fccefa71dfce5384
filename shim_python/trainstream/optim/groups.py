# SPDX-License-Identifier: Apache-2.0
"""A parameter group's hyper-parameters as the daemon and as torch's optimizers take them, and
the names the daemon accepts for a parameter."""

from __future__ import annotations


def torch_group(g: dict) -> dict:
    """A group's hyper-parameters as torch's optimizers name them."""
    return dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"],
                weight_decay=g["weight_decay"])


def daemon_group(g: dict) -> dict:
    """A group's hyper-parameters as the daemon takes them (plain floats)."""
    return dict(lr=float(g["lr"]), betas=tuple(float(b) for b in g["betas"]),
                eps=float(g["eps"]), weight_decay=float(g["weight_decay"]))


def safe_name(name: str) -> str:
    """``name`` in the characters the daemon allows in a parameter's name."""
    allowed = "".join(c if c.isalnum() or c in "_.:/-" else "_" for c in name)
    return allowed[:120] or "param"

