"""How activations and gradients travel between pipeline stages, and how the driver drives them.

Every transport runs the same schedule on the same stage actors; they differ only in the path
the tensors take and in how many actor calls the driver makes:

- ``p2p``: the stages join a gloo process group and send/receive among themselves; the driver
  makes one call per stage per ``--batches-per-call`` global batches.
- ``compiled``: a Ray Compiled Graph with one node per op (nccl channels between GPU stages).
- ``actor_calls``: one Ray actor call per op, activations passing as object references.

A transport ``submit``s a chunk of global batches and ``collect``s their losses; a stage that
dies surfaces as one of ``STAGE_FAILURES``, a batch that never ends as ``BatchTimeout``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError, RayTaskError

from ray_jobs.core.batches import microbatches
from ray_jobs.errors import PeerLost
from ray_jobs.pipeline.schedules import BACKWARD, FORWARD, SCHEDULES, execution_order

TRANSPORTS = ("auto", "p2p", "compiled", "actor_calls")
# What a dead stage looks like to the driver, through any transport (p2p: a peer's send or
# receive fails before Ray reports the dead actor).
STAGE_FAILURES = (RayActorError, RayChannelError, PeerLost)


class TransportFailed(RuntimeError):
    """The transport could not be set up (a graph that does not compile, a group that never forms)."""


class BatchTimeout(RuntimeError):
    """A submitted call's batches did not finish in time."""


def resolve_transport(scaling, nodes: list[str], precision: str = "fp32", needs_group: bool = False) -> str:
    """``auto``: GPU stages on one node, each on its own GPU, talk over nccl through a compiled
    graph (GPU to GPU); everything else uses p2p. p2p stays on gloo even between GPUs: nccl matches sends and
    receives by order, not tag, and a stage's interleaved sends and early-posted receives
    could then wait on each other; through host memory they cannot."""
    if scaling.transport != "auto":
        return scaling.transport
    # Stages that may share a GPU cannot be nccl peers: p2p (gloo) carries them. fp16's stages
    # agree on skipping overflowing steps, clipping stages sum their gradients' norms, and stages
    # holding one weight sum its gradients (``needs_group``), over p2p's process group, which only
    # p2p has.
    one_node = len(set(nodes)) == 1
    nccl = scaling.use_gpu and one_node and not scaling.shared_gpus and precision != "fp16" and not needs_group
    return "compiled" if nccl else "p2p"


def replicas_backend(scaling) -> str:
    """The backend of a stage's copies' group (--data-parallel): nccl between GPU stages, each on a
    device of its own, so the gradient average (or the sharded stage's collectives) stays on the
    devices; gloo otherwise. The hops between stages stay on gloo (see ``resolve_transport``)."""
    return "nccl" if scaling.use_gpu and not scaling.shared_gpus else "gloo"


def connect(requested: str, actors: list, nodes: list[str], scaling, device_transport: bool):
    """Set up the ``requested`` transport between started stage actors."""
    if requested == "p2p":
        return P2P(actors, scaling)
    order = execution_order(SCHEDULES[scaling.schedule](scaling.num_stages, scaling.num_microbatches))
    if requested == "actor_calls":
        return ActorCalls(actors, order, scaling.num_microbatches)
    if len(set(nodes)) > 1:
        # Measured on Ray 2.60 (local multi-node cluster): compiled-graph channels between
        # nodes never delivered and the run hung.
        warnings.warn(
            "--transport compiled with stages on several nodes hung on Ray 2.60 here; "
            "--transport p2p is the tested choice",
            stacklevel=2,
        )
    return CompiledGraph(actors, order, scaling.num_microbatches, device_transport)


class P2P:
    """torch.distributed (gloo) send/recv between the stage actors themselves."""

    name = "p2p_gloo"

    def __init__(self, actors: list, scaling) -> None:
        self.actors, self.batches_per_call = actors, scaling.batches_per_call
        timeout = scaling.batch_timeout_s
        try:
            address = ray.get(actors[0].rendezvous_address.remote(timeout), timeout=timeout)
        except GetTimeoutError:
            raise TransportFailed(f"stage 0 gave no rendezvous address within --batch-timeout-s {timeout:g}") from None
        backend = replicas_backend(scaling)
        joins = [actor.join_group.remote(address, scaling.schedule, timeout, backend) for actor in actors]
        try:
            # Failing fast: a stage that cannot join must not leave the others waiting out the timeout.
            get_failing_fast(joins, timeout)
        except GetTimeoutError:
            raise TransportFailed(
                f"the stages' gloo group at {address} did not form within --batch-timeout-s {timeout:g}"
            ) from None

    def submit(self, chunk: list[torch.Tensor]):
        # One tensor of row indices per call: Ray pickles each tensor separately.
        rows = torch.stack(chunk)
        return [actor.run_batches.remote(rows) for actor in self.actors]

    def collect(self, handle, timeout_s: float) -> list[float]:
        return _timed(lambda: get_failing_fast(handle, timeout_s)[-1])

    def discard(self, handles: list) -> None:
        """Calls given up on after another failed: their errors are taken, not printed."""
        _take_errors([ref for handle in handles for ref in handle])

    def close(self) -> None:
        """The group ends with its actors."""


class ActorCalls:
    """One actor call per op; the driver chains them with object references."""

    name = "actor_calls"
    batches_per_call = 1

    def __init__(self, actors: list, order: list, num_microbatches: int) -> None:
        self.actors, self.order, self.num_microbatches = actors, order, num_microbatches

    def submit(self, chunk: list[torch.Tensor]):
        (batch,) = chunk
        rows = microbatches(batch, self.num_microbatches)
        last = len(self.actors) - 1
        outputs = {}
        for stage, op in self.order:
            m = op.microbatch
            if op.kind == FORWARD:
                activation = outputs[(stage - 1, FORWARD, m)] if stage > 0 else None
                outputs[(stage, FORWARD, m)] = self.actors[stage].forward.remote(m, activation, rows[m])
            else:
                grad = outputs[(stage + 1, BACKWARD, m)] if stage < last else None
                outputs[(stage, BACKWARD, m)] = self.actors[stage].backward.remote(m, grad)
        return list(outputs.values()), [actor.step.remote() for actor in self.actors]

    def collect(self, handle, timeout_s: float) -> list[float]:
        ops, steps = handle
        try:
            return _timed(lambda: [get_failing_fast(steps, timeout_s)[-1]])
        except RayTaskError:
            # A failed op fails every op that consumes its output, and a step then finds
            # micro-batches that never went backward: the first failed op, in submission order,
            # is the cause.
            for ref in ops:
                try:
                    ray.get(ref, timeout=0)
                except RayTaskError:
                    raise
                except GetTimeoutError:
                    continue
            raise

    def discard(self, handles: list) -> None:
        """Calls given up on after another failed: their errors are taken, not printed."""
        _take_errors([ref for ops, steps in handles for ref in [*ops, *steps]])

    def close(self) -> None:
        """Nothing outlives the calls."""


class CompiledGraph:
    """The schedule compiled once into a Ray Compiled Graph, executed once per global batch."""

    batches_per_call = 1

    def __init__(self, actors: list, order: list, num_microbatches: int, device_transport: bool) -> None:
        self.num_microbatches = num_microbatches
        self.name = "compiled_graph_nccl" if device_transport else "compiled_graph"
        self.batch_seconds = 0.0  # running estimate of one batch's duration
        try:
            self.graph = build_graph(actors, order, device_transport).experimental_compile()
        except Exception as error:  # Ray raises several types for graphs it cannot compile
            raise TransportFailed(f"--transport compiled: the compiled graph failed to build: {error}") from error

    def submit(self, chunk: list[torch.Tensor]):
        (batch,) = chunk
        return self.graph.execute(*microbatches(batch, self.num_microbatches)), time.perf_counter()

    def collect(self, handle, timeout_s: float) -> list[float]:
        ref, submitted = handle
        # Waiting on a compiled graph's result busy-polls a whole core; sleep through most of a
        # batch's expected duration first so the stages keep the CPU.
        time.sleep(max(0.0, 0.8 * self.batch_seconds - (time.perf_counter() - submitted)))
        began = time.perf_counter()
        losses = _timed(lambda: [ray.get(ref, timeout=timeout_s)[-1]])
        self.batch_seconds = 0.5 * self.batch_seconds + 0.5 * (time.perf_counter() - max(began, submitted))
        return losses

    def discard(self, handles: list) -> None:
        """Nothing to take: the graph's teardown ends what it still runs."""

    def close(self) -> None:
        # Ray logs each step of a normal teardown at INFO; only problems are worth showing.
        logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)
        self.graph.teardown()


def _timed(get):
    """Ray's timeouts, as one type for the driver's message."""
    try:
        return get()
    except (GetTimeoutError, RayChannelTimeoutError):
        raise BatchTimeout from None


def get_failing_fast(refs: list, timeout_s: float) -> list:
    """``ray.get`` of every ref, raising the first failure as soon as it happens: a stage
    blocked on a dead peer must not hide the dead stage's error until its own timeout."""
    deadline, waiting = time.monotonic() + timeout_s, list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise GetTimeoutError(f"{len(waiting)} stage results still missing after {timeout_s:g} s")
        try:
            ray.get(ready)
        except Exception:
            _take_errors(waiting)
            raise
    return ray.get(refs)


# How long a failed call waits for the other stages' calls to fail too. Their errors (a lost peer,
# seen at once by gloo) are then taken here: an error Ray finds unread when its reference goes
# prints a traceback ("Unhandled error") after the run has already said what happened.
DRAIN_S = 2.0


def _take_errors(refs: list) -> None:
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DRAIN_S)
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)


def build_graph(actors: list, order: list, device_transport: bool) -> MultiOutputNode:
    """The schedule as a Ray Compiled Graph: one node per op, bound in ``order`` (which each
    actor then executes in), with activations and gradients on direct actor-to-actor channels."""
    last = len(actors) - 1
    outputs, consumed = {}, set()
    with InputNode() as rows:
        for stage, op in order:
            m = op.microbatch
            if op.kind == FORWARD:
                source = (stage - 1, FORWARD, m) if stage > 0 else None
                node = actors[stage].forward.bind(m, outputs[source] if source else None, rows[m])
            else:
                source = (stage + 1, BACKWARD, m) if stage < last else (stage, FORWARD, m)
                node = actors[stage].backward.bind(m, outputs[source])
            consumed.add(source)
            sends_tensor = stage < last if op.kind == FORWARD else stage > 0
            if device_transport and sends_tensor:
                node = node.with_tensor_transport("nccl")
            outputs[(stage, op.kind, m)] = node
        # Every output must feed something, and every node needs an input: a stage's step
        # waits on its unconsumed outputs and on its last op.
        steps = []
        for stage in range(len(actors)):
            own = [key for key in outputs if key[0] == stage]
            waits = [key for key in own if key not in consumed or key == own[-1]]
            steps.append(actors[stage].step.bind(*[outputs[key] for key in waits]))
        return MultiOutputNode(steps)
