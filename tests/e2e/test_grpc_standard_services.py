# SPDX-License-Identifier: Apache-2.0
"""The daemon's gRPC endpoint answers the standard services with the standard Python clients:
health (grpcio-health-checking), SERVING until a drain starts and NOT_SERVING from then on, for
our service by name and for the server as a whole (service ""), and server reflection
(grpcio-reflection), through which a generic client such as grpcurl learns the API without our
.proto files."""

from __future__ import annotations

import signal

import pytest

grpc = pytest.importorskip("grpc")
health_pb2 = pytest.importorskip(
    "grpc_health.v1.health_pb2", reason="grpcio-health-checking is installed by bootstrap.sh")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
reflection_db = pytest.importorskip(
    "grpc_reflection.v1alpha.proto_reflection_descriptor_database",
    reason="grpcio-reflection is installed by bootstrap.sh")

from conftest import wait_until  # noqa: E402

SERVICE = "trainstream.v1.TrainStream"


def _status(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


# "" is the server as a whole: what Kubernetes' gRPC probes and grpc_health_probe ask by default.
@pytest.mark.parametrize("service", ["", SERVICE], ids=["server", "service"])
def test_health_is_serving_then_not_serving_from_the_start_of_a_drain(daemon, service):
    import trainstream

    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        assert _status(channel, service) == health_pb2.HealthCheckResponse.SERVING
        session = trainstream.connect(daemon.socket)  # keeps the drain waiting
        daemon.process.send_signal(signal.SIGTERM)
        assert wait_until(
            lambda: _status(channel, service) == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        # Still draining (the session is open): NOT_SERVING is the drain's, not the exit's.
        assert daemon.process.poll() is None
        session.close()
    assert daemon.process.wait(10) == 0


def test_reflection_describes_the_api_to_a_generic_client(daemon):
    from google.protobuf.descriptor_pool import DescriptorPool

    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        database = reflection_db.ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in set(database.get_services())
        service = DescriptorPool(database).FindServiceByName(SERVICE)
        methods = {m.name: m for m in service.methods}
        assert {"OpenSession", "Heartbeat", "CloseSession", "AllocateBuffer"} <= set(methods)
        assert methods["OpenSession"].input_type.full_name == "trainstream.v1.OpenSessionRequest"
        fields = {f.name for f in methods["OpenSession"].input_type.fields}
        assert "job_id" in fields
