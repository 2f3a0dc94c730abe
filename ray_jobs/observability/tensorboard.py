"""TensorBoard event files under ``<run_dir>/tensorboard/``, written by one process: world rank 0
(the driver for the pipeline). ``tensorboard --logdir runs/`` shows every run side by side.

Scalars: ``train/loss`` (global-batch losses, x = global step), ``train/epoch_loss``, ``val/loss``,
``val/accuracy``, ``perf/samples_per_second`` and ``lr`` (x = epoch, 1-based). One event file per
attempt, flushed at every epoch's end. For a URI run directory (``s3://``) the file is written
locally and copied into the run directory after every epoch, since tensorboardX cannot reach
every store raypar can.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

# tensorboardX's synchronous writer, not its SummaryWriter: SummaryWriter writes from a thread
# that flush() does not wait for (a worker exiting after its last epoch lost that epoch's
# events), and opening one per epoch to close it cost 57 ms an epoch; this writer 12 ms
# (measured: 500 train/loss points and 5 epoch scalars, flushed).
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary

from ray_jobs.core.evaluation import Validation
from ray_jobs.data import storage

LOG_DIR = "tensorboard"
# train/loss points per epoch at most: a long epoch logs every N-th global batch, so event files
# stay small (a point is ~50 bytes) and TensorBoard's charts stay responsive.
MAX_STEP_POINTS_PER_EPOCH = 500


class TrainLog:
    def __init__(self, run_dir: storage.Target) -> None:
        filesystem, path = storage.resolve(storage.join(run_dir, LOG_DIR))
        self.remote = None if filesystem.type_name == "local" else storage.join(run_dir, LOG_DIR)
        self.local = path if self.remote is None else tempfile.mkdtemp(prefix="raypar-tensorboard-")
        os.makedirs(self.local, exist_ok=True)
        # The name has the time in seconds only: the suffix tells apart attempts within one second.
        self.writer = EventsWriter(os.path.join(self.local, "events"), f".{uuid.uuid4().hex[:8]}")

    def epoch(
        self,
        epoch: int,
        step_losses: list[float],
        loss: float,
        validation: Validation | None,
        samples_per_second: float | None,
        lr: float,
        step_lrs: list[float] | None = None,
        grad_norms: list[float] | None = None,
    ) -> None:
        """Epoch ``epoch``'s (0-based) scalars; its global batches are steps ``epoch * len(step_losses)`` on;
        ``lr``: the epoch's last step's, ``step_lrs``: each step's (``--lr-schedule``); ``grad_norms``:
        the gradient norm before clipping of the epoch's last ``len(grad_norms)`` steps (``--grad-clip-norm``)."""
        every = max(1, len(step_losses) // MAX_STEP_POINTS_PER_EPOCH)
        for step in range(0, len(step_losses), every):
            self._scalar("train/loss", step_losses[step], epoch * len(step_losses) + step + 1)
            if step_lrs is not None:
                self._scalar("train/lr", step_lrs[step], epoch * len(step_losses) + step + 1)
        first = len(step_losses) - len(grad_norms or [])
        for step in range(first, len(step_losses), every):
            self._scalar("train/grad_norm", grad_norms[step - first], epoch * len(step_losses) + step + 1)
        x = epoch + 1
        self._scalar("train/epoch_loss", loss, x)
        if validation is not None:
            self._scalar("val/loss", validation.loss, x)
            if validation.accuracy is not None:
                self._scalar("val/accuracy", validation.accuracy, x)
            if validation.perplexity is not None:
                self._scalar("val/perplexity", validation.perplexity, x)
        if samples_per_second is not None:
            self._scalar("perf/samples_per_second", samples_per_second, x)
        self._scalar("lr", lr, x)
        self.writer.flush()
        if self.remote is not None:
            for name in os.listdir(self.local):  # this writer's one file
                with open(os.path.join(self.local, name), "rb") as file:
                    storage.write_bytes(storage.join(self.remote, name), file.read())

    def _scalar(self, tag: str, value: float, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self.writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))
