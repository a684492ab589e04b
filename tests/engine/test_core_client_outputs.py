"""CoreClient's output reader: every message of the core reaches the handler once and in order,
those that arrived before the reader started and bursts longer than one drain alike; a handler that
raises marks the core dead instead of losing the loop silently. Real ZMQ sockets over ipc://; no
core process (the sockets are what is under test)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from pagoda.config import EngineArgs
from pagoda.contracts.messages import EngineCoreOutputs, encode
from pagoda.engine import core_client
from pagoda.engine.core_client import CoreClient


async def _client_with_peer(tmp_path) -> tuple[CoreClient, zmq.Socket, zmq.Context]:
    """A CoreClient whose output socket is bound as start() binds it, and the PUSH peer the core
    would connect."""
    client = CoreClient(EngineArgs())
    client._loop = asyncio.get_running_loop()
    client._ctx = zmq.Context()
    client._actx = zmq.asyncio.Context.shadow(client._ctx)
    client.output = client._actx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/output.sock"
    client.output.bind(address)
    peer_ctx = zmq.Context()
    peer = peer_ctx.socket(zmq.PUSH)
    peer.connect(address)
    return client, peer, peer_ctx


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_every_message_reaches_the_handler_in_order(tmp_path):
    n_before, n_after = 3, 5 * core_client._DRAIN_BATCH + 7

    async def main() -> list[float]:
        client, peer, peer_ctx = await _client_with_peer(tmp_path)
        # Read once through the asyncio socket first, as wait_ready does, so that its own reader
        # is registered when the output loop takes the descriptor over.
        peer.send(encode(EngineCoreOutputs(timestamp=-1.0)))
        assert (await client.recv()).timestamp == -1.0
        for i in range(n_before):  # queued before the reader exists: the descriptor will not fire for them
            peer.send(encode(EngineCoreOutputs(timestamp=float(i))))
        await asyncio.sleep(0.1)
        seen: list[float] = []
        client.start_output_loop(lambda msg: seen.append(msg.timestamp))
        await _wait_for(lambda: len(seen) >= n_before)  # with nothing newer arriving to wake the reader
        for i in range(n_before, n_before + n_after):  # one burst, many drains long
            peer.send(encode(EngineCoreOutputs(timestamp=float(i))))
        await _wait_for(lambda: len(seen) >= n_before + n_after)
        await asyncio.sleep(0.05)  # nothing extra arrives
        client._stop_output_reader()
        peer.close(linger=0)
        peer_ctx.term()
        client.output.close(linger=0)
        client._ctx.term()
        return seen

    seen = asyncio.run(main())
    assert seen == [float(i) for i in range(n_before + n_after)]


def test_a_failing_handler_marks_the_core_dead(tmp_path):
    async def main() -> tuple[str | None, int]:
        client, peer, peer_ctx = await _client_with_peer(tmp_path)
        calls = []

        def handler(msg: EngineCoreOutputs) -> None:
            calls.append(msg)
            raise ValueError("bad message")

        client.start_output_loop(handler)
        peer.send(encode(EngineCoreOutputs(timestamp=1.0)))
        await _wait_for(lambda: client.is_dead)
        peer.send(encode(EngineCoreOutputs(timestamp=2.0)))  # the reader is gone: not handled
        await asyncio.sleep(0.1)
        peer.close(linger=0)
        peer_ctx.term()
        client.output.close(linger=0)
        client._ctx.term()
        return client.dead_reason, len(calls)

    reason, calls = asyncio.run(main())
    assert calls == 1
    assert reason is not None and "output loop failed" in reason and "bad message" in reason
