"""How p2p pipeline stages exchange activations and gradients with their neighbours.

Two kinds of link, chosen per pair of neighbouring stages:

- ``GlooLinks``: torch.distributed (gloo) send/recv over TCP, between any two nodes.
- ``SharedMemoryLinks``: between stages on one node. A message is copied into a slot of a
  shared-memory segment and announced by its tag on a pipe. A gloo message on loopback is a
  round trip through both peers' I/O threads, which on a busy node must first win a CPU from
  the stages' compute (measured here: ~5% of every stage's time outside its ops, against ~2.5%
  for these links); here a send is one copy and one ``write``, and the waiting stage itself
  is woken.

Both take the batch's receives in order up front (``start_batch``), so gloo can post them
early, and raise ``PeerLost`` when the peer died or stopped answering.
"""
from __future__ import annotations

import math
import mmap
import os
import secrets
import select
import struct
import time
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

# Receives posted ahead of need (gloo); more only holds more buffers.
RECEIVES_AHEAD = 2
SHARED_MEMORY_DIR = "/dev/shm"  # tmpfs: a segment there is memory, never written to disk
NOTICE = struct.Struct("<qq")  # a message's tag and byte count, written after its bytes


class PeerLost(RuntimeError):
    """A p2p send or receive failed: the peer stage died or timed out."""


class Receive(NamedTuple):
    """One message a stage will receive: for which op, from which peer, of what shape."""

    op: object  # schedules.Op
    peer: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    tag: int


def shared_memory_room(num_bytes: int) -> bool:
    """Whether segments of ``num_bytes`` in all fit in this node's shared memory, with room to
    spare: containers often mount a small /dev/shm (Docker: 64 MiB), which Ray's object store
    uses too."""
    if not (os.path.isdir(SHARED_MEMORY_DIR) and os.access(SHARED_MEMORY_DIR, os.W_OK) and hasattr(os, "mkfifo")):
        return False
    stats = os.statvfs(SHARED_MEMORY_DIR)
    return stats.f_bavail * stats.f_frsize >= 2 * num_bytes


class GlooLinks:
    """gloo send/recv. Sends are asynchronous and waited on at the batch's end, so no two
    stages can block sending to each other. Receives are posted ``RECEIVES_AHEAD`` early:
    gloo moves a message only once its receive is posted, so one posted at the moment of need
    pays a round trip through both peers' I/O threads on the pipeline's critical path."""

    def __init__(self) -> None:
        self.planned: deque[Receive] = deque()
        self.posted: deque = deque()
        self.sends: list = []  # (work, tensor): the tensor must outlive its asynchronous send

    def start_batch(self, receives: list[Receive]) -> None:
        self.planned, self.posted, self.sends = deque(receives), deque(), []

    def receive(self, op) -> tuple[torch.Tensor, float]:
        """The message for ``op``, and the seconds spent blocked on it."""
        while self.planned and len(self.posted) < RECEIVES_AHEAD:
            planned = self.planned.popleft()
            buffer = torch.empty(planned.shape, dtype=planned.dtype)  # gloo: host memory
            self.posted.append((planned.op, _gloo(dist.irecv, buffer, planned.peer, tag=planned.tag), buffer))
        posted_op, work, buffer = self.posted.popleft()
        _check_order(posted_op, op)
        began = time.perf_counter()
        _gloo(work.wait)
        return buffer, time.perf_counter() - began

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.sends.append((_gloo(dist.isend, tensor, peer, tag=tag), tensor))

    def finish_batch(self) -> None:
        for work, _ in self.sends:
            _gloo(work.wait)
        self.sends = []


class SharedMemoryLinks:
    """Shared-memory links to the neighbours on this stage's node.

    Each direction of each link has one slot per micro-batch. A slot is never overwritten
    before it is read: a stage sends batch k+1's message for micro-batch m only after its own
    optimizer step of batch k, which waits (through the messages between) until the neighbour
    has taken every batch-k message. The notice after the bytes carries the tag and size, so
    any other order fails loudly instead of reading stale data.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_ms = int(timeout_s * 1000)
        self.incoming: dict[int, _Channel] = {}
        self.outgoing: dict[int, _Channel] = {}
        self.planned: deque[Receive] = deque()

    def open_incoming(self, token: str, stage_index: int, peer: int, num_slots: int, slot_bytes: int) -> None:
        """Create the segment and pipe ``peer`` sends on; the sender removes their names."""
        path = _path(token, peer, stage_index)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserved now: a full tmpfs then fails here, not with SIGBUS at the first send.
            os.posix_fallocate(fd, 0, num_slots * slot_bytes)
            memory = mmap.mmap(fd, num_slots * slot_bytes)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        os.mkfifo(path + ".notices", 0o600)
        # Non-blocking open: no writer yet. Once the writer is gone (its process ended), a read
        # returns end of file at once, so a dead peer is noticed without waiting out a timeout.
        notices = os.open(path + ".notices", os.O_RDONLY | os.O_NONBLOCK)
        self.incoming[peer] = _Channel(memory, notices, slot_bytes)

    def open_outgoing(self, token: str, stage_index: int, peer: int, slot_bytes: int) -> None:
        path = _path(token, stage_index, peer)
        fd = os.open(path, os.O_RDWR)
        try:
            memory = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        notices = os.open(path + ".notices", os.O_WRONLY)
        # Both ends are open, so the names can go: nothing is left behind however the stages
        # end (a killed actor runs no clean-up).
        os.unlink(path)
        os.unlink(path + ".notices")
        self.outgoing[peer] = _Channel(memory, notices, slot_bytes)

    def start_batch(self, receives: list[Receive]) -> None:
        self.planned = deque(receives)

    def receive(self, op) -> tuple[torch.Tensor, float]:
        """The message for ``op``, and the seconds spent blocked on it."""
        planned = self.planned.popleft()
        _check_order(planned.op, op)
        channel = self.incoming[planned.peer]
        began = time.perf_counter()
        tag, num_bytes = NOTICE.unpack(self._read_notice(channel, planned.peer))
        waited = time.perf_counter() - began
        expected = math.prod(planned.shape) * planned.dtype.itemsize
        if (tag, num_bytes) != (planned.tag, expected):
            raise RuntimeError(f"link from stage {planned.peer}: got tag {tag} ({num_bytes} bytes), "
                               f"expected tag {planned.tag} ({expected} bytes)")
        # A copy: an activation stays alive until its backward, and its slot may be reused first.
        return channel.view(planned.tag, planned.shape, planned.dtype).clone(), waited

    def _read_notice(self, channel: _Channel, peer: int) -> bytes:
        poller = select.poll()
        poller.register(channel.notices, select.POLLIN)
        if not poller.poll(self.timeout_ms):
            raise PeerLost(f"no message from stage {peer} within {self.timeout_ms / 1000:g} s")
        notice = os.read(channel.notices, NOTICE.size)
        if not notice:
            raise PeerLost(f"stage {peer} closed its link (its process ended)")
        if len(notice) != NOTICE.size:  # a pipe write under PIPE_BUF bytes is atomic
            raise RuntimeError(f"link from stage {peer}: a torn notice of {len(notice)} bytes")
        return notice

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        channel = self.outgoing[peer]
        channel.view(tag, tensor.shape, tensor.dtype).copy_(tensor)
        try:
            os.write(channel.notices, NOTICE.pack(tag, tensor.numel() * tensor.element_size()))
        except OSError as error:  # BrokenPipeError: the receiver's process ended
            raise PeerLost(f"stage {peer}: {error}") from None

    def finish_batch(self) -> None:
        """Nothing to wait for: a send is complete when ``send`` returns."""


class _Channel:
    """One direction of a link: the mapped slots and this side's end of the pipe."""

    def __init__(self, memory: mmap.mmap, notices: int, slot_bytes: int) -> None:
        self.memory, self.notices, self.slot_bytes = memory, notices, slot_bytes
        self.num_slots = len(memory) // slot_bytes

    def view(self, tag: int, shape, dtype: torch.dtype) -> torch.Tensor:
        # A micro-batch's forward and backward travel in opposite directions, on different
        # channels, so the micro-batch alone picks the slot.
        count = math.prod(shape)
        if count * dtype.itemsize > self.slot_bytes:
            raise RuntimeError(f"a message of {count * dtype.itemsize} bytes does not fit a {self.slot_bytes}-byte slot")
        offset = (tag % self.num_slots) * self.slot_bytes
        return torch.frombuffer(self.memory, dtype=dtype, count=count, offset=offset).view(shape)


def slot_bytes(rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    # Rounded up to a cache line, so neighbouring slots never share one.
    return -(-rows * math.prod(shape) * dtype.itemsize // 64) * 64


def new_token() -> str:
    """A name prefix no other pipeline on the node uses."""
    return secrets.token_hex(6)


def _path(token: str, sender: int, receiver: int) -> str:
    return os.path.join(SHARED_MEMORY_DIR, f"raypar-{token}-{sender}-{receiver}")


def _check_order(planned_op, op) -> None:
    if planned_op != op:
        raise RuntimeError(f"receive for {planned_op} planned, {op} needed")


def _gloo(call, *args, **kwargs):
    """A send, receive or wait; its failure means a peer died or timed out. gloo raises
    ``DistBackendError`` or a plain ``RuntimeError`` (both seen), so only these calls are
    wrapped: a RuntimeError from compute is a bug, not a lost peer."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as error:
        raise PeerLost(f"{str(error).splitlines()[0] if str(error) else error!r}") from None
