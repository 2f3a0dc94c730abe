"""``TrainConfig``'s flags for the run as a whole: where it is stored and under which name, its
checkpoints and retries (``CheckpointFlags``), and how long it waits for a cluster to grow
(``PlacementFlags``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.core.flags import flag_doc

CHECKPOINT_MODES = ("sync", "async")


@dataclass
class CheckpointFlags:
    """The run directory, its checkpoints and retries (``--help`` section ``checkpoints``)."""

    checkpoint_every: int = field(
        default=1, metadata=flag_doc("checkpoint every N epochs (and always at the end)", "checkpoints")
    )
    num_checkpoints_to_keep: int = field(
        default=2, metadata=flag_doc("checkpoints kept in the run directory", "checkpoints")
    )
    storage_path: str = field(
        default="./runs", metadata=flag_doc("run storage: a local path or s3:// / gs:// URI", "checkpoints")
    )
    name: str | None = field(
        default=None, metadata=flag_doc("run name; re-running a name resumes it", "checkpoints", "strategy + timestamp")
    )
    checkpoint_every_steps: int = field(
        default=0,
        metadata=flag_doc(
            "also checkpoint every K global batches within an epoch (0: off); a resume restarts at that step",
            "checkpoints",
        ),
    )
    checkpoint_mode: str = field(
        default="sync",
        metadata=flag_doc(
            "sync: training waits while a checkpoint is written and uploaded; async: only while its state is "
            "copied to host memory, then the write and upload run in the background, one at a time (a failed "
            "one fails the run; the run ends once its last checkpoint is whole)",
            "checkpoints",
            choices=CHECKPOINT_MODES,
        ),
    )
    max_failures: int = field(
        default=0,
        metadata=flag_doc("worker-group restarts allowed, each resuming from the latest checkpoint", "checkpoints"),
    )


@dataclass
class PlacementFlags:
    """Waiting for the cluster (``--help`` section ``placement``, beside each strategy's own placement flags)."""

    resource_timeout: float = field(
        default=300.0,
        metadata=flag_doc(
            "seconds to wait for an autoscaling cluster to add the nodes a run needs "
            "(a fixed-size cluster that lacks them fails at once)",
            "placement",
        ),
    )
