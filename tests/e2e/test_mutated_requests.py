# SPDX-License-Identifier: Apache-2.0
"""Random requests to every RPC of the API over raw gRPC: fields filled with edge values
(negative and huge numbers, NaN, empty and very long strings, unknown enum values, a real
session's id or another), repeated and nested fields included. The daemon must answer each
within its deadline with success or a client error carrying a message, never INTERNAL or
UNKNOWN, and keep serving. Sized for CI (300 requests); ``TS_LONG=1`` sends 12,000 and prints
the figures (``TS_SHOW=1`` prints them for the short run)."""

from __future__ import annotations

import collections
import math
import os
import random
import time

import grpc
from google.protobuf.descriptor import FieldDescriptor as F

# What a malformed request may get back: the daemon refused it, and said why.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
                 grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
INTS = [0, 1, -1, 7, 2**31 - 1, -2**31, 2**63 - 1, -2**63]
UINTS = [0, 1, 7, 4096, 2**32, 2**40, 2**63, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e-3, 3.5, 1e300, -1e300, math.inf, -math.inf, math.nan]


def _repeated(field) -> bool:
    # protobuf 5.28+ has is_repeated; older versions only the label (since removed)
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == F.LABEL_REPEATED


class Mutator:
    def __init__(self, rng: random.Random, session_ids: list, folder: str):
        self.rng = rng
        self.session_ids = session_ids
        self.folder = folder

    def string(self, name: str) -> str:
        r = self.rng
        if "session" in name:
            return r.choice(self.session_ids + ["", "s-0", "s-" + "9" * 40, "not a session"])
        if "path" in name:  # never a file outside this test's folder
            return r.choice(["", "relative/file", "/nonexistent/dir/file", self.folder,
                             os.path.join(self.folder, f"f{r.randrange(4)}"),
                             os.path.join(self.folder, "..", "..", "x" * 300)])
        return r.choice(["", "v", "job", "a" * r.choice([255, 256, 4097, 70_000]), "\x00",
                         "../../etc", "é\u2028\U0001f600", "%s%n", " "])

    def value(self, field):
        r = self.rng
        t = field.type
        if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
            return r.choice([v for v in INTS if -2**31 <= v < 2**31])
        if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            return r.choice(INTS)
        if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
            return r.choice([v for v in UINTS if v < 2**32])
        if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
            return r.choice(UINTS)
        if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return r.choice(FLOATS)
        if t == F.TYPE_BOOL:
            return r.random() < 0.5
        if t == F.TYPE_STRING:
            return self.string(field.name)
        if t == F.TYPE_BYTES:
            return bytes(r.randrange(256) for _ in range(r.choice([0, 1, 17, 300])))
        if t == F.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return r.choice(numbers + [max(numbers) + 1, 1000])
        raise AssertionError(f"unhandled field type {t} of {field.full_name}")

    def fill(self, message, depth: int = 0) -> None:
        for field in message.DESCRIPTOR.fields:
            if self.rng.random() < 0.3:
                continue  # left at its default
            if _repeated(field):
                count = self.rng.choice([0, 1, 3, 40])
                container = getattr(message, field.name)
                if field.type == F.TYPE_MESSAGE:
                    if field.message_type.GetOptions().map_entry:
                        key_field = field.message_type.fields_by_name["key"]
                        value_field = field.message_type.fields_by_name["value"]
                        for _ in range(count):
                            key = self.value(key_field)
                            if value_field.type == F.TYPE_MESSAGE:
                                if depth < 3:
                                    self.fill(container[key], depth + 1)
                            else:
                                container[key] = self.value(value_field)
                    elif depth < 3:
                        for _ in range(count):
                            self.fill(container.add(), depth + 1)
                else:
                    container.extend(self.value(field) for _ in range(count))
            elif field.type == F.TYPE_MESSAGE:
                if depth < 3:
                    self.fill(getattr(message, field.name), depth + 1)
            else:
                setattr(message, field.name, self.value(field))


def _methods(pb):
    # Drain is left out: any request of it from root succeeds by stopping the daemon (its own
    # tests are in test_tsctl.py and test_system_socket.py).
    service = pb.DESCRIPTOR.services_by_name["TrainStream"]
    return [(service, m) for m in service.methods if m.name != "Drain"]


def test_mutated_requests_get_client_errors_and_the_daemon_keeps_serving(daemon, stub, pb,
                                                                       tmp_path):
    from tsapi import trainstream_pb2_grpc  # noqa: F401 - the generated service

    long_run = os.environ.get("TS_LONG") == "1"
    count = 12_000 if long_run else 300
    rng = random.Random(2812)
    opened = [stub.OpenSession(pb.OpenSessionRequest(job_id=f"m{i}", pid=os.getpid())).session_id
              for i in range(2)]
    mutator = Mutator(rng, opened, str(tmp_path))
    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    calls = {}
    for service, method in _methods(pb):
        request_class = getattr(pb, method.input_type.name)
        reply_class = getattr(pb, method.output_type.name)
        path = f"/{service.full_name}/{method.name}"
        make = channel.unary_stream if method.server_streaming else channel.unary_unary
        calls[method.name] = (request_class, method.server_streaming,
                              make(path, request_serializer=request_class.SerializeToString,
                                   response_deserializer=reply_class.FromString))
    names = sorted(calls)
    codes = collections.Counter()
    wrong = []
    started = time.monotonic()
    for n in range(count):
        name = names[n % len(names)]
        request_class, streaming, call = calls[name]
        request = request_class()
        mutator.fill(request)
        try:
            if streaming:
                # Read until the deadline ends the stream: an open stream is not a hang.
                for _ in call(request, timeout=0.3):
                    pass
            else:
                call(request, timeout=5)
            codes[grpc.StatusCode.OK] += 1
        except grpc.RpcError as e:
            code = e.code()
            codes[code] += 1
            expected = code in CLIENT_ERRORS or (
                streaming and code == grpc.StatusCode.DEADLINE_EXCEEDED)  # a stream stays open
            if not expected or (code != grpc.StatusCode.CANCELLED and not e.details()):
                wrong.append((name, code, e.details(), str(request)[:300]))
        assert daemon.process.poll() is None, (name, str(request)[:500], daemon.log()[-3000:])
    seconds = time.monotonic() - started
    channel.close()
    assert not wrong, wrong[:5]
    # Still serving, and each RPC was tried.
    assert stub.GetStatus(pb.GetStatusRequest()).reserved_bytes >= 0
    assert count >= len(names)
    if long_run or os.environ.get("TS_SHOW"):
        summary = ", ".join(f"{c.name} {k}" for c, k in codes.most_common())
        print(f"\n{count} mutated requests over {len(names)} RPCs in {seconds:.0f} s: {summary}; "
              "0 crashes, 0 hangs, 0 internal or unknown errors")
