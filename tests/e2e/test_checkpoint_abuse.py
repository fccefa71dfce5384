# SPDX-License-Identifier: Apache-2.0
"""Optimizer checkpoints that lie, and saves that were killed: a count in the metadata that is
negative, fractional or too large is refused with the file named (a -1 once loaded as step
18446744073709551615), and the temporary file a killed save leaves is removed by the next save
to the same path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn  # noqa: E402


def _trained(tmp_path):
    torch.manual_seed(0)
    model, opt = trainstream.wrap(TinyGPT(layers=1), lr=1e-3, device="cpu", offload=True)
    x, y = batch(0, device="cpu")
    loss_fn(model, x, y).backward()
    opt.step()
    path = str(tmp_path / "opt.safetensors")
    opt.save(path)
    return model, opt, path


def _rewrite(path, change):
    """The checkpoint at ``path`` with its trainstream metadata passed through ``change``."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(metadata["trainstream"])
    change(meta)
    metadata["trainstream"] = json.dumps(meta)
    safetensors_torch.save_file(tensors, path, metadata=metadata)


@pytest.mark.parametrize("field,value", [("iteration", -1), ("iteration", 1.5),
                                         ("iteration", 1e30), ("step", -1)])
def test_a_count_that_is_not_one_is_refused(tmp_path, field, value):
    model, opt, path = _trained(tmp_path)

    def change(meta):
        if field == "iteration":
            meta["iteration"] = value
        else:
            meta["params"][0]["step"] = value
    _rewrite(path, change)
    with pytest.raises(trainstream.InvalidArgumentError, match="is not a count"):
        opt.load(path)
    assert opt.steps == 1  # the live state is as it was
    trainstream.unwrap(model)


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    model, opt, path = _trained(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process has ended: the killed daemon's
    abandoned = f"{path}.tmp-{gone.pid}-{'0123456789abcdef'}"
    live = f"{path}.tmp-{os.getpid()}-{'fedcba9876543210'}"  # a save still being written
    other = str(tmp_path / "other.safetensors.tmp-1-0123456789abcdef")  # not this checkpoint's
    for name in (abandoned, live, other):
        with open(name, "wb") as f:
            f.write(b"partial")
    opt.save(path)
    assert not os.path.exists(abandoned)
    assert os.path.exists(live) and os.path.exists(other)
    opt.load(path)  # the checkpoint itself is whole
    trainstream.unwrap(model)


def test_a_path_the_caller_got_wrong_is_its_error_not_an_internal_one(tmp_path):
    """Saving under a regular file (ENOTDIR) came back as INTERNAL."""
    model, opt, path = _trained(tmp_path)
    with pytest.raises(trainstream.InvalidArgumentError, match="Not a directory"):
        opt.save(os.path.join(path, "inside-a-file.safetensors"))
    trainstream.unwrap(model)
