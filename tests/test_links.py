"""Shared-memory links between pipeline stages, both ends in this process (no Ray)."""
from __future__ import annotations

import os

import pytest
import torch

from ray_jobs import links
from ray_jobs.links import PeerLost, Receive, SharedMemoryLinks, shared_memory_room, slot_bytes
from ray_jobs.schedules import BACKWARD, FORWARD, Op

pytestmark = pytest.mark.skipif(not shared_memory_room(1), reason="no writable /dev/shm here")

NUM_MICROBATCHES, ROWS, WIDTH = 4, 3, 5


@pytest.fixture
def pair():
    """Stage 0 and stage 1 linked both ways, as the pipeline's driver connects them."""
    token, size = links.new_token(), slot_bytes(ROWS, (WIDTH,), torch.float32)
    stages = [SharedMemoryLinks(timeout_s=0.2), SharedMemoryLinks(timeout_s=0.2)]
    for index, stage in enumerate(stages):
        stage.open_incoming(token, index, 1 - index, NUM_MICROBATCHES, size)
    for index, stage in enumerate(stages):
        stage.open_outgoing(token, index, 1 - index, size)
    yield token, stages


def expect(op: Op, peer: int) -> Receive:
    tag = op.microbatch + (0 if op.kind == FORWARD else NUM_MICROBATCHES)
    return Receive(op, peer, (ROWS, WIDTH), torch.float32, tag)


def test_messages_arrive_exactly_in_both_directions_and_leave_no_names(pair):
    token, (first, second) = pair
    assert not [name for name in os.listdir(links.SHARED_MEMORY_DIR) if token in name]
    activations = [torch.randn(ROWS, WIDTH) for _ in range(NUM_MICROBATCHES)]
    second.start_batch([expect(Op(FORWARD, m), 0) for m in range(NUM_MICROBATCHES)])
    for m, activation in enumerate(activations):
        first.send(activation, 1, m)
    for m, activation in enumerate(activations):
        got, waited = second.receive(Op(FORWARD, m))
        assert torch.equal(got, activation) and waited >= 0
    gradient = torch.randn(ROWS, WIDTH)
    first.start_batch([expect(Op(BACKWARD, 2), 1)])
    second.send(gradient, 0, 2 + NUM_MICROBATCHES)
    assert torch.equal(first.receive(Op(BACKWARD, 2))[0], gradient)


def test_a_received_tensor_is_a_copy_that_a_later_send_does_not_change(pair):
    _, (first, second) = pair
    second.start_batch([expect(Op(FORWARD, 0), 0), expect(Op(FORWARD, 0), 0)])
    first.send(torch.ones(ROWS, WIDTH), 1, 0)
    got = second.receive(Op(FORWARD, 0))[0]
    first.send(torch.zeros(ROWS, WIDTH), 1, 0)  # the same slot, as the next batch would
    assert torch.equal(got, torch.ones(ROWS, WIDTH))


def test_a_message_out_of_order_fails_loudly(pair):
    _, (first, second) = pair
    second.start_batch([expect(Op(FORWARD, 0), 0)])
    first.send(torch.ones(ROWS, WIDTH), 1, 1)
    with pytest.raises(RuntimeError, match="got tag 1 .* expected tag 0"):
        second.receive(Op(FORWARD, 0))


def test_a_receive_the_schedule_did_not_plan_fails(pair):
    _, (_, second) = pair
    second.start_batch([expect(Op(FORWARD, 0), 0)])
    with pytest.raises(RuntimeError, match="planned"):
        second.receive(Op(FORWARD, 1))


def test_a_silent_peer_times_out(pair):
    _, (_, second) = pair
    second.start_batch([expect(Op(FORWARD, 0), 0)])
    with pytest.raises(PeerLost, match="no message from stage 0 within 0.2 s"):
        second.receive(Op(FORWARD, 0))


def test_a_peer_whose_process_ended_is_noticed_at_once(pair):
    _, (first, second) = pair
    os.close(first.outgoing[1].notices)  # what the kernel does when the sender's process ends
    second.start_batch([expect(Op(FORWARD, 0), 0)])
    with pytest.raises(PeerLost, match="stage 0 closed its link"):
        second.receive(Op(FORWARD, 0))


def test_sending_to_a_peer_whose_process_ended_raises_peer_lost(pair):
    _, (first, second) = pair
    os.close(second.incoming[0].notices)
    with pytest.raises(PeerLost, match="stage 1"):
        first.send(torch.ones(ROWS, WIDTH), 1, 0)


def test_a_message_larger_than_its_slot_is_refused(pair):
    _, (first, _) = pair
    with pytest.raises(RuntimeError, match="does not fit"):
        first.send(torch.ones(ROWS * 4, WIDTH), 1, 0)


def test_no_room_in_shared_memory_means_no_shared_links():
    stats = os.statvfs(links.SHARED_MEMORY_DIR)
    assert not shared_memory_room(stats.f_blocks * stats.f_frsize)


def test_slots_are_whole_cache_lines():
    assert slot_bytes(3, (5,), torch.float32) == 64 and slot_bytes(32, (1024,), torch.float32) == 131072
