"""How a Ray Train worker hands a checkpoint to Ray Train: at once (``--checkpoint-mode sync``),
or in the background (``async``).

In async mode the loop waits only while the checkpoint's state is copied to host memory: the
replicas' ``checkpoint.pt`` tensors by a copy here, an fsdp rank's shards by
``dcp.async_save``'s staging (its write then runs in a thread, over a gloo group of its own so its
collectives never meet the training's). Ray Train's ``CheckpointUploadMode.ASYNC`` then runs our
upload function in its one upload thread: it waits for the shards, writes ``checkpoint.pt``
(world rank 0) and persists the directory into the run's storage. At most one save is in flight:
the next one first waits for the last. A failed write or upload raises in that thread, which
Ray Train turns into the worker's failure: the run fails in one line naming the checkpoint. Ray
Train flushes its upload thread when the training function returns, so a run ends only once its
last checkpoint is whole; the last one is written in sync anyway (the final weights come with
it). A save cut short leaves a checkpoint that ``usable_checkpoints`` passes over.

Runs in the worker; imports nothing that runs only on the driver.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray.train
import torch
from torch.utils._pytree import tree_map_only

from ray_jobs.core.checkpoint import TrainState, write_checkpoint
from ray_jobs.errors import described


def host_copy(tree: Any) -> Any:
    """Every tensor in ``tree`` copied to host memory: the training may change its own at once."""
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True), tree)


class CheckpointSaver:
    """One worker's checkpoints; ``stalls_s`` holds how long each held the training loop."""

    def __init__(self, mode: str, on_upload: Callable[[str], None] | None = None) -> None:
        self.mode, self.on_upload = mode, on_upload
        self.stalls_s: list[float] = []
        self._last: threading.Event | None = None
        self._failure: BaseException | None = None
        if mode == "async":
            _quiet_background_failures()

    def wait(self) -> None:
        """Until the last background save is done; its failure, raised here too: training stops at
        the next checkpoint at the latest, not only when Ray Train next looks at the worker."""
        if self._last is not None:
            self._last.wait()
        if self._failure is not None:
            raise self._failure

    def background(self, final: bool) -> bool:
        """Whether this checkpoint goes in the background: async mode, and not the run's last."""
        return self.mode == "async" and not final

    def save(
        self,
        name: str,
        metrics: dict[str, Any],
        state: Callable[[], TrainState] | None,
        write_shards: Callable[[str, bool], Future | bool],
        final: bool,
        began: float,
    ) -> None:
        """Hand checkpoint ``name`` to Ray Train (every rank calls this: a report is a barrier).
        ``state``: world rank 0's ``checkpoint.pt`` (None elsewhere), built after the wait for the
        last save; ``write_shards(directory, in_background)``: this rank's shards, if the model is
        sharded, written at once or returned as the background write's future."""
        in_background = self.background(final)
        self.wait()  # at most one in flight, in either mode
        directory = tempfile.mkdtemp(prefix="raypar-ckpt-")
        try:
            shards = write_shards(directory, in_background)
            whole = state() if state is not None else None
            if in_background and whole is not None:
                whole = dataclasses.replace(whole, model=host_copy(whole.model), optimizer=host_copy(whole.optimizer))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        attached = whole is not None or shards is not False
        if not in_background:
            try:
                if whole is not None:
                    write_checkpoint(directory, whole)
                report(metrics, directory if attached else None, name)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            self.stalls_s.append(time.perf_counter() - began)
            return
        done = threading.Event()
        self._last = done
        storage_context = ray.train.get_context().get_storage()

        def upload(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            try:
                with described(f"checkpoint {dir_name}: its background write"):
                    if isinstance(shards, Future):
                        shards.result()
                    if whole is not None:
                        write_checkpoint(directory, whole)
                    if self.on_upload is not None:
                        self.on_upload(dir_name)  # the tests' fault seam
                    return storage_context.persist_current_checkpoint(checkpoint, dir_name)
            except BaseException as error:
                self._failure = error
                raise
            finally:
                shutil.rmtree(directory, ignore_errors=True)
                done.set()

        if attached:
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=name,
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                checkpoint_upload_fn=upload,
                delete_local_checkpoint_after_upload=False,  # ``upload`` removes it, failed or not
            )
        else:
            shutil.rmtree(directory, ignore_errors=True)
            done.set()
            mode = ray.train.CheckpointUploadMode.ASYNC
            ray.train.report(metrics, checkpoint_dir_name=name, checkpoint_upload_mode=mode)
        self.stalls_s.append(time.perf_counter() - began)


class _BackgroundFailure(logging.Filter):
    """Ray Train logs a failed background upload with its traceback before it fails the worker
    with the same error, which then reaches the terminal as the run's one ``error:`` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed in the background thread" not in record.getMessage()


def _quiet_background_failures() -> None:
    from ray.train.v2._internal.execution import context

    logger = logging.getLogger(context.__file__)  # Ray names this module's logger by its path
    if not any(isinstance(existing, _BackgroundFailure) for existing in logger.filters):
        logger.addFilter(_BackgroundFailure())


def report(metrics: dict[str, Any], directory: str | None = None, name: str | None = None) -> None:
    """Every rank reports (it is a barrier); the ranks with a checkpoint ``directory`` attach it,
    and Ray Train uploads each into the one checkpoint directory ``name``."""
    if directory is None:
        ray.train.report(metrics)
        return
    # Named by progress: resume and model.pt take the checkpoint with the most work done.
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory), checkpoint_dir_name=name)
