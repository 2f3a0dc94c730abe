"""The bench's communication model: the bytes one optimizer step moves over a node's own links
and between nodes, for each way of laying a transformer on 2 nodes x 8 GPUs. Computed, not
measured: it says what the layouts cost where this 2-CPU machine cannot show it.

The model, stated so it can be checked:
- collectives are rings; over n ranks an all-reduce of X bytes has every rank send
  2(n-1)/n·X to its neighbour, an all-gather or a reduce-scatter (n-1)/n·X. A ring over ranks on
  k > 1 nodes, laid node by node, crosses between nodes on k of its n edges; on one node, none;
- weights are gathered in bf16 (2 bytes a parameter), gradients reduced in fp32 (4 bytes), as
  raypar's bf16 FSDP policy does; activations and their gradients cross stages in bf16;
- fsdp reshards after forward (two all-gathers a step), a sharded pipeline stage does not
  (one); a pipeline's bubble is (S-1)/(M+S-1), the others have none;
- a pipeline's stages are consecutive ranks, node by node; DP x PP lays data innermost, so a
  stage's copies share a node (``PipelineScaling.bundle_index``).

The rings' inputs, the buffers each layout hands to its collectives, are what this machine can
check: ``handed`` states them for the layouts case's runs (fp32, one node), and that case sets
them beside the bytes its processes counted (``--count-comm-bytes``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

WEIGHT_BYTES, GRAD_BYTES, ACTIVATION_BYTES = 2, 4, 2


@dataclass(frozen=True)
class Transformer:
    name: str
    parameters: int
    layers: int
    d_model: int
    context: int


# GPT-2 small and GPT-2 XL (the 1.5B model), their published shapes.
MODELS = (
    Transformer("GPT-2 124M", 124_439_808, 12, 768, 1024),
    Transformer("GPT-2 1.5B", 1_557_611_200, 48, 1600, 1024),
)
NODES, GPUS_PER_NODE = 2, 8
GLOBAL_BATCH = 512  # sequences per optimizer step
MICROBATCHES_PER_STAGE = 4  # M = 4·S per replica: a pipeline's usual fill


@dataclass
class Traffic:
    """Bytes over all of a step's links, split by where the link runs."""

    intra: float = 0.0
    inter: float = 0.0

    def ring(self, size: int, nbytes: float, sends_per_rank: float, nodes: int) -> None:
        """A ring of ``size`` ranks on ``nodes`` nodes, each rank sending ``sends_per_rank``·``nbytes``."""
        if size < 2:
            return
        per_edge = sends_per_rank * nbytes
        crossing = nodes if nodes > 1 else 0
        self.inter += crossing * per_edge
        self.intra += (size - crossing) * per_edge

    def all_reduce(self, size: int, nbytes: float, nodes: int, groups: int = 1) -> None:
        for _ in range(groups):
            self.ring(size, nbytes, 2 * (size - 1) / size, nodes)

    def gather_or_scatter(self, size: int, nbytes: float, nodes: int, groups: int = 1) -> None:
        for _ in range(groups):
            self.ring(size, nbytes, (size - 1) / size, nodes)


def layouts(model: Transformer, nodes: int = NODES, per_node: int = GPUS_PER_NODE) -> list[dict[str, Any]]:
    """One row per layout of ``nodes`` x ``per_node`` GPUs: its bytes per step and its bubble."""
    world = nodes * per_node
    weights, grads = model.parameters * WEIGHT_BYTES, model.parameters * GRAD_BYTES
    row_activation = model.context * model.d_model * ACTIVATION_BYTES  # one sequence across one cut
    rows = []

    def add(name: str, traffic: Traffic | None, bubble: float = 0.0, note: str = "") -> None:
        rows.append(
            {
                "layout": name,
                "intra_bytes": traffic.intra if traffic else None,
                "inter_bytes": traffic.inter if traffic else None,
                "bubble": bubble,
                "note": note,
            }
        )

    ddp = Traffic()
    ddp.all_reduce(world, grads, nodes)
    add(f"DDP ({world} replicas)", ddp)
    fsdp = Traffic()
    fsdp.gather_or_scatter(world, weights, nodes)  # forward's all-gather
    fsdp.gather_or_scatter(world, weights, nodes)  # backward's, resharded after forward
    fsdp.gather_or_scatter(world, grads, nodes)  # reduce-scatter
    add(f"fsdp ({world} shards)", fsdp)
    hsdp = Traffic()
    hsdp.gather_or_scatter(per_node, weights, 1, groups=2 * nodes)  # two all-gathers per node
    hsdp.gather_or_scatter(per_node, grads, 1, groups=nodes)
    hsdp.all_reduce(nodes, grads / per_node, nodes, groups=per_node)  # each shard across the nodes
    add(f"HSDP ({nodes} x {per_node}: shard in a node, replicate across)", hsdp)

    def pipeline(replicas: int, stages: int, sharded: bool) -> tuple[Traffic, float]:
        microbatches = MICROBATCHES_PER_STAGE * stages
        traffic = Traffic()
        # Each replica's M micro-batches of GLOBAL_BATCH / replicas rows cross S-1 cuts forward and back.
        per_cut = 2 * (GLOBAL_BATCH / replicas) * row_activation

        def node(stage: int, replica: int) -> int:  # bundles stage by stage, a stage's copies side by side
            return (stage * replicas + replica) // per_node

        for cut in range(stages - 1):
            for replica in range(replicas):
                if node(cut, replica) != node(cut + 1, replica):
                    traffic.inter += per_cut
                else:
                    traffic.intra += per_cut
        if replicas > 1:
            stage_weights, stage_grads = weights / stages, grads / stages
            if sharded:
                traffic.gather_or_scatter(replicas, stage_weights, 1, groups=stages)  # once: no reshard
                traffic.gather_or_scatter(replicas, stage_grads, 1, groups=stages)
            else:
                traffic.all_reduce(replicas, stage_grads, 1, groups=stages)
        return traffic, (stages - 1) / (microbatches + stages - 1)

    if model.layers >= world:
        add(f"PP ({world} stages)", *pipeline(1, world, False))
    else:
        add(f"PP ({world} stages)", None, note=f"{model.layers} layers: fewer than {world} stages")
    add(f"DP x PP ({per_node} replicas x {nodes} stages, data innermost)", *pipeline(per_node, nodes, False))
    add(f"FSDP x PP ({per_node} shards x {nodes} stages)", *pipeline(per_node, nodes, True))
    return rows


@dataclass(frozen=True)
class Params:
    """A model's parameters as FSDP2 sees them: each one's (first dimension, element count), in the
    groups resharded after forward (gathered twice a step) and in those kept to backward (gathered
    once: the root's own, as FSDP2 keeps its root, and the last ``shard_units`` group, whose
    backward follows its forward at once; ``sharding.Shards.wrap``)."""

    resharded: tuple[tuple[int, int], ...]
    kept: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return sum(n for _, n in self.resharded + self.kept)

    def padded(self, shards: int, part: str = "all") -> int:
        """Elements once each parameter's first dimension is padded to a multiple of ``shards``,
        as FSDP2 shards it (``torch.chunk``'s even chunks)."""
        params = {"resharded": self.resharded, "kept": self.kept, "all": self.resharded + self.kept}[part]
        return sum(math.ceil(dim0 / shards) * shards * (n // dim0) for dim0, n in params)


def handed(
    layout: str, params: Params, processes: int, batch_rows: int, row_activation: int, element: int = 4
) -> dict[str, float]:
    """Bytes all ``processes`` together hand to each kind of call in one optimizer step of
    ``layout`` (one of the layouts case's, on 2 groups or 2 replicas where it has them): an
    all-reduce its tensor, an all-gather its output, a reduce-scatter its input, a send or receive
    its tensor (``observability.comm_bytes`` counts the same). ``row_activation``: the elements of
    one row's activation at a stage cut; ``element``: bytes per element (fp32: 4)."""
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")
    bytes_ = dict.fromkeys(kinds, 0.0)
    if layout == "ddp":
        bytes_["all_reduce"] = processes * params.count * element
    elif layout == "hsdp":
        shards = processes // 2
        gathered = 2 * params.padded(shards, "resharded") + params.padded(shards, "kept")
        bytes_["all_gather"] = processes * gathered * element
        bytes_["reduce_scatter"] = processes * params.padded(shards) * element
        bytes_["all_reduce"] = processes * params.padded(shards) / shards * element  # each shard, across groups
    else:
        replicas = 1 if layout == "pipeline" else 2
        stages = processes // replicas
        # Each cut: every row's activation forward and its gradient back, over all replicas' shares.
        bytes_["send"] = bytes_["recv"] = 2 * (stages - 1) * batch_rows * row_activation * element
        if layout == "dp_x_pp":  # each stage's gradients and the last stage's loss, one buffer each copy
            bytes_["all_reduce"] = replicas * (params.count + 1) * element
        elif layout == "fsdp_x_pp":  # gathered once a step (not resharded), reduced once a step
            bytes_["all_gather"] = bytes_["reduce_scatter"] = replicas * params.padded(replicas) * element
            bytes_["all_reduce"] = replicas * element  # the loss
    return bytes_


def comm_model_case(bench=None, results: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bench's case: the model for GPT-2 124M and 1.5B on 2 nodes x 8 GPUs; measures nothing."""
    return {
        "nodes": NODES,
        "gpus_per_node": GPUS_PER_NODE,
        "global_batch": GLOBAL_BATCH,
        "microbatches_per_stage": MICROBATCHES_PER_STAGE,
        "models": [{**asdict(model), "layouts": layouts(model)} for model in MODELS],
    }
