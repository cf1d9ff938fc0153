"""What the gRPC tests share: a broker on port 0 on the fake clock, and a stub on a channel to it.
A module that needs another broker (a store of its own, other flags) defines its own ``broker``;
``stub`` then connects to that one."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.helpers import running_broker
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqwire.pb import broker_pb2_grpc as pb_grpc


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, rng=random.Random(7)) as b:
        yield b


@pytest.fixture
async def stub(broker: Broker) -> AsyncIterator[pb_grpc.BrokerAsyncStub]:
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        yield pb_grpc.BrokerStub(channel)
