"""TensorBoard event files under ``<run_dir>/tensorboard/``, written by one process: world rank 0
(the driver for the pipeline). ``tensorboard --logdir runs/`` shows every run side by side.

Scalars: ``train/loss`` (global-batch losses, x = global step), ``train/epoch_loss``, ``val/loss``,
``val/accuracy``, ``perf/samples_per_second`` and ``lr`` (x = epoch, 1-based). Event files go
straight into a local run directory; for a URI (``s3://``) they are written locally and copied
into the run directory after every epoch, since tensorboardX cannot reach every store raypar can.
"""
from __future__ import annotations

import os
import tempfile

from tensorboardX import SummaryWriter

from ray_jobs import storage
from ray_jobs.validation import Validation

LOG_DIR = "tensorboard"
# train/loss points per epoch at most: a long epoch logs every N-th global batch, so event files
# stay small (a point is ~50 bytes) and TensorBoard's charts stay responsive.
MAX_STEP_POINTS_PER_EPOCH = 500


class TrainLog:
    def __init__(self, run_dir: storage.Target) -> None:
        filesystem, path = storage.resolve(storage.join(run_dir, LOG_DIR))
        self.remote = None if filesystem.type_name == "local" else storage.join(run_dir, LOG_DIR)
        self.local = path if self.remote is None else tempfile.mkdtemp(prefix="raypar-tensorboard-")

    def epoch(self, epoch: int, step_losses: list[float], loss: float, validation: Validation | None,
              samples_per_second: float | None, lr: float) -> None:
        """Epoch ``epoch``'s (0-based) scalars; its global batches are steps ``epoch * len(step_losses)`` on.

        One event file per epoch, closed at once: tensorboardX writes from a thread that a flush
        does not wait for, and a worker may exit (or crash) right after its last epoch."""
        suffix = f".epoch{epoch + 1:06d}"
        with SummaryWriter(logdir=self.local, filename_suffix=suffix) as writer:
            every = max(1, len(step_losses) // MAX_STEP_POINTS_PER_EPOCH)
            for step in range(0, len(step_losses), every):
                writer.add_scalar("train/loss", step_losses[step], epoch * len(step_losses) + step + 1)
            x = epoch + 1
            writer.add_scalar("train/epoch_loss", loss, x)
            if validation is not None:
                writer.add_scalar("val/loss", validation.loss, x)
                if validation.accuracy is not None:
                    writer.add_scalar("val/accuracy", validation.accuracy, x)
            if samples_per_second is not None:
                writer.add_scalar("perf/samples_per_second", samples_per_second, x)
            writer.add_scalar("lr", lr, x)
        if self.remote is not None:
            for name in os.listdir(self.local):
                if name.endswith(suffix):
                    with open(os.path.join(self.local, name), "rb") as file:
                        storage.write_bytes(storage.join(self.remote, name), file.read())
