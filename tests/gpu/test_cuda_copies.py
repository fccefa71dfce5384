# SPDX-License-Identifier: Apache-2.0
"""Daemon segments registered with CUDA: 1 GiB each way through them, every byte checked."""

import pytest

import trainstream

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

GIB = 1 << 30


def test_segments_are_registered_and_copy_1gib_each_way(start_daemon):
    d = start_daemon("--memory_budget=8G")
    ok, why = trainstream.cuda_available()
    assert ok, why
    with trainstream.connect(d.socket, job_id="gpu") as client:
        up = client.allocate("up", GIB, tag="test")
        down = client.allocate("down", GIB, tag="test")
        assert up.cuda_registered and down.cuda_registered
        host_up = up.tensor(torch.int32)
        gen = torch.Generator().manual_seed(1234)
        host_up.copy_(torch.randint(-2**31, 2**31 - 1, host_up.shape, dtype=torch.int32,
                                    generator=gen))
        # torch.Tensor.is_pinned() knows only torch's own host allocator, so it reads False
        # here; the copies below go through the client library, which uses the registration.
        device = torch.empty(GIB // 4, dtype=torch.int32, device="cuda")
        up.copy_to_device(device)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), host_up)

        device.mul_(3).add_(7)
        expected = device.cpu()
        host_down = down.tensor(torch.int32)
        host_down.fill_(0)
        down.copy_from_device(device)
        torch.cuda.synchronize()
        assert torch.equal(host_down, expected)
        # The bytes are in the daemon's segment: another session of the job sees them.
        with trainstream.connect(d.socket, job_id="gpu") as other:
            assert torch.equal(other.lookup("down").tensor(torch.int32)[:1024], expected[:1024])


def test_copy_range_is_checked(start_daemon):
    d = start_daemon("--memory_budget=1G")
    with trainstream.connect(d.socket) as client:
        buf = client.allocate("small", 4096)
        dst = torch.empty(2048, dtype=torch.int32, device="cuda")
        with pytest.raises(trainstream.InvalidArgumentError, match="past the end"):
            buf.copy_to_device(dst)
        with pytest.raises(trainstream.InvalidArgumentError, match="past the end"):
            buf._native.copy_to_device(4000, dst.data_ptr(), 200, 0)


def test_torch_copies_from_daemon_memory_are_correct(start_daemon):
    d = start_daemon("--memory_budget=2G")
    with trainstream.connect(d.socket) as client:
        buf = client.allocate("t", 256 << 20)
        host = buf.tensor(torch.float32)
        host.uniform_()
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), host)


def test_torch_copies_cross_the_gib_marks_of_a_large_segment(start_daemon):
    # A 1.5 GiB range of a 2.5 GiB buffer contains a GiB mark of its segment, wherever the buffer
    # starts in it: had the segment been registered in 1 GiB pieces, a copy spanning two would
    # fail with cudaErrorInvalidValue (the 14B bases' weight matrices did).
    d = start_daemon("--memory_budget=4G")
    with trainstream.connect(d.socket) as client:
        buf = client.allocate("large", 5 * GIB // 2)
        assert buf.cuda_registered
        host = buf.tensor(torch.int32)
        gen = torch.Generator().manual_seed(99)
        window = slice(3 * GIB // 16, 9 * GIB // 16)  # in int32 elements: [0.75, 2.25) GiB
        host[window].copy_(torch.randint(-2**31, 2**31 - 1, (host[window].numel(),),
                                         dtype=torch.int32, generator=gen))
        dev = host[window].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), host[window])
        dev.add_(1)
        host[window].copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host[window], dev.cpu())


def test_gradients_sent_from_device_land_and_are_posted(start_daemon):
    """HostOptimizer.send_gradient and send_gradients (a batch behind one event): the copies
    run on the caller's stream and a native thread posts them once landed; the update that
    follows reads exactly the device's gradients."""
    from trainstream import HostOptimizer, ParameterSpec

    d = start_daemon("--memory_budget=2G")
    with trainstream.connect(d.socket, job_id="sender") as client:
        shapes = [(1000,), (257, 3)]
        opt = HostOptimizer(client, [ParameterSpec(f"p{i}", s, torch.float32)
                                     for i, s in enumerate(shapes)],
                            groups=[dict(lr=1e-2, weight_decay=0.0)])
        weights = [torch.randn(s) for s in shapes]
        opt.load_weights(weights)
        too_big = torch.zeros(1001, device="cuda")
        with pytest.raises(trainstream.InvalidArgumentError,
                           match="a 4004-byte gradient does not fit its 4000-byte buffer"):
            opt.send_gradient(0, 0, too_big, torch.cuda.current_stream())
        # In a batch, the oversized one is refused before anything of the batch is sent.
        with pytest.raises(trainstream.InvalidArgumentError,
                           match="a 4004-byte gradient does not fit its 4000-byte buffer"):
            opt.send_gradients([(1, 0, torch.zeros(shapes[1], device="cuda")),
                                (0, 0, too_big)], torch.cuda.current_stream())
        reference = [torch.nn.Parameter(w.clone()) for w in weights]
        ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0)
        stream = torch.cuda.Stream()
        for step in range(3):
            grads = [torch.randn(s, device="cuda") for s in shapes]
            stream.wait_stream(torch.cuda.current_stream())  # after the gradients are made
            with torch.cuda.stream(stream):  # sent from a stream of the caller's
                doubled = [g.mul(2.0) for g in grads]
                if step == 1:  # one batch, one event
                    opt.send_gradients(list(zip(range(len(shapes)), [0, 0], doubled)),
                                       stream.cuda_stream)
                else:
                    for i, g in enumerate(doubled):
                        opt.send_gradient(i, 0, g, stream)
            opt.drain_gradients()  # every post is rung: the daemon has them all
            result = opt.wait()
            assert result["updated"] == [True, True] and not result["skipped"]
            for p, g in zip(reference, grads):
                p.grad = (g * 2.0).cpu()
            ref_opt.step()
            for i, p in enumerate(reference):
                assert torch.allclose(opt.master(i), p.detach(), rtol=1e-5, atol=1e-6), step


def test_copy_pieces_moves_a_batch_both_ways_in_one_call(start_daemon):
    """copy_pieces (the pager's copies of a block's weights and activations): every piece
    lands where asked, between a daemon buffer and device memory, in either direction."""
    from trainstream import _trainstream

    d = start_daemon("--memory_budget=1G")
    with trainstream.connect(d.socket, job_id="pieces") as client:
        buffer = client.allocate("pieces", 4 << 20, tag="test")
        host = buffer.tensor(torch.float32)
        host.copy_(torch.arange(host.numel(), dtype=torch.float32))
        device = torch.zeros_like(host, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the zeros
        quarter = host.numel() // 4
        # Quarters 0, 2 and 3 in, quarter 1 left alone.
        _trainstream.copy_pieces(stream.cuda_stream,
                                 [(device[k * quarter:].data_ptr(), host[k * quarter:].data_ptr(),
                                   quarter * 4) for k in (0, 2, 3)])
        stream.synchronize()
        expected = host.clone()
        expected[quarter:2 * quarter] = 0
        assert torch.equal(device.cpu(), expected)
        # Out again: the first half of the device tensor over the buffer's second half.
        device.add_(1)
        stream.wait_stream(torch.cuda.current_stream())
        half = host.numel() // 2
        _trainstream.copy_pieces(stream.cuda_stream,
                                 [(host[half:].data_ptr(), device.data_ptr(), half * 4)])
        stream.synchronize()
        assert torch.equal(host[half:], expected[:half] + 1)
        assert torch.equal(host[:half], torch.arange(half, dtype=torch.float32))
        with pytest.raises(trainstream.TrainStreamError,
                           match="cudaMemcpyAsync of piece 0 of 1 \\(16 bytes\\) failed"):
            _trainstream.copy_pieces(stream.cuda_stream, [(0, host.data_ptr(), 16)])
