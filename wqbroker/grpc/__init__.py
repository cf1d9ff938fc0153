"""The gRPC API (grpc.aio): the same operations as the HTTP API over the same service, plus
StreamJobs, which pushes tasks to workers."""

from wqbroker.grpc.server import CODES, BrokerServicer, create_server

__all__ = ["CODES", "BrokerServicer", "create_server"]
