# SPDX-License-Identifier: Apache-2.0
"""On a machine without a GPU: the daemon says so in an event, and CUDA copies fail clearly."""

import pytest

import trainstream

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_missing_gpu_is_an_event_not_a_crash(daemon):
    with trainstream.connect(daemon.socket) as client:
        status = client.status()
        assert status["gpus"] == []
        assert status["gpu_note"]
        assert any(e["kind"] == "gpu.none" for e in client.events())
        ok, why = trainstream.cuda_available()
        assert not ok and why
        buf = client.allocate("x", 4096)
        assert not buf.cuda_registered
        with pytest.raises(trainstream.FailedPreconditionError, match="not registered with CUDA"):
            buf._native.copy_to_device(0, 0, 16, 0)
