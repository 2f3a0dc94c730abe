"""Ray Train orchestration shared by the DDP, FSDP and DataParallel strategies.

All run the same worker loop under ``TorchTrainer``; they differ only in worker scaling and in
how the model is held (``wrap.Replicas``, ``sharding.Shards``), which the caller passes in.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import asdict

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.api.config import LoggingConfig

from ray_jobs.core.checkpoint import latest_checkpoint, latest_progress
from ray_jobs.core.config import WorkerScaling
from ray_jobs.core.failure_record import recorded_failure
from ray_jobs.data import storage
from ray_jobs.data.stream import reader_stats, stream_reader
from ray_jobs.data_parallel.process_group import ProcessGroupConfig
from ray_jobs.data_parallel.worker import LoopConfig, train_loop_per_worker
from ray_jobs.data_parallel.wrap import Replicas
from ray_jobs.driver import interrupts
from ray_jobs.driver.connect import WORKER_ENV, env_defaults, ray_started_here
from ray_jobs.driver.outputs import finish, finish_trained
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.resources import Request, gpu_sharing, wait_for_bundles
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.errors import TrainingFailed, root_cause, storage_named
from ray_jobs.testing.faults import NO_FAULTS, Faults

# Ray Train's registry of a run's checkpoints (ray.train.v2._internal.constants).
REGISTRY_FILE = "checkpoint_manager_snapshot.json"
# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default), and a worker's report waits until the controller has taken the one before: epochs
# shorter than that were held to one per poll, and a run's end was seen up to a poll late.
# Measured here (0.6 s epochs, 2 workers): at 2 s, reports blocked 1.2-1.5 s each and the run
# spent 9 s after its last epoch; at 0.5 s no report blocked and that tail took 1-2 s. A user's
# own setting of the variable wins.
CONTROLLER_POLL_S = "0.5"
CONTROLLER_POLL_VARIABLE = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# Ray Train's preemption watcher (an actor per worker group) only logs node drains and flags them
# to ray.train.get_preemption_info(), which raypar does not read: it recovers from a lost node by
# its checkpoints. Its actor printed an ERROR line from Ray's core on every run ("constructor
# arguments in the object store and max_restarts > 0"). Off, unless the user turns it on.
PREEMPTION_WATCHER_VARIABLE = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
CONTROLLER_ENV = {CONTROLLER_POLL_VARIABLE: CONTROLLER_POLL_S, PREEMPTION_WATCHER_VARIABLE: "0"}


def run_workers(
    prepared: PreparedRun,
    scaling: WorkerScaling,
    wrap: Replicas,
    faults: Faults = NO_FAULTS,
) -> TrainSummary:
    """Train ``prepared`` with ``scaling.num_workers`` Ray Train workers; Ray must be connected.
    ``faults``: what a test arms."""
    cfg = prepared.cfg
    scaling.check(cfg)
    trained = finish_trained(prepared, {"scaling": asdict(scaling)}, scaling.num_workers)
    if trained is not None:
        return trained
    # An elastic run may start on a cluster already short of nodes: only its minimum must fit.
    num_workers, flag = (
        (scaling.min_workers, "--min-workers") if scaling.elastic else (scaling.num_workers, "--num-workers")
    )
    bundles = [scaling.resources_per_worker] * num_workers
    wait_for_bundles(
        bundles, scaling.placement_strategy, _request(prepared.strategy, flag, num_workers), cfg.resource_timeout
    )
    with stream_reader(prepared, latest_progress(prepared.run_dir)) as reader:
        return _fit(prepared, scaling, wrap, reader, faults)


def _fit(prepared: PreparedRun, scaling: WorkerScaling, wrap, reader, faults: Faults) -> TrainSummary:
    cfg = prepared.cfg
    _drop_unreadable_registry(prepared.run_dir)
    loop = LoopConfig(
        train=asdict(cfg),
        dataset=ray.put(prepared.dataset),
        initial_state=ray.put(prepared.initial_state),
        wrap=wrap,
        num_threads=max(1, int(scaling.cpus_per_worker)),
        run_dir=storage.locate(prepared.run_dir),  # the driver's filesystem settings travel with it
        reader=reader,
        model_factory=prepared.model_factory,
        val_dataset=ray.put(prepared.val_dataset) if prepared.val_dataset is not None else None,
        faults=faults,
    )
    trainer = _trainer(
        vars(loop),
        torch_config=_process_group(scaling),
        scaling_config=ScalingConfig(
            num_workers=(scaling.min_workers, scaling.num_workers) if scaling.elastic else scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker=scaling.resources_per_worker,
            placement_strategy=scaling.placement_strategy,
            **({"elastic_resize_monitor_interval_s": scaling.resize_interval} if scaling.resize_interval else {}),
        ),
        run_config=RunConfig(
            name=prepared.name,
            **_storage_options(prepared.storage_path),
            # A bounded controller budget: Ray's default (-1) retries an unschedulable run forever.
            failure_config=FailureConfig(max_failures=cfg.max_failures, controller_failure_limit=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            worker_runtime_env={"env_vars": WORKER_ENV},
            # raypar prints its own progress, and a failure's root cause in one line; Ray Train's
            # per-report INFO lines and its ERROR tracebacks (the controller's, every worker's: ~40
            # lines for one full disk) would drown both. They stay in Ray Train's own log files
            # (<Ray session>/logs/train), which keep every level whatever this says.
            logging_config=LoggingConfig(log_level="CRITICAL"),
        ),
    )
    try:
        with env_defaults(CONTROLLER_ENV):  # fit() passes the driver's values on to the controller
            result = _fit_interruptibly(trainer)
    except ray.train.TrainingFailedError as error:
        raise TrainingFailed(storage_named(root_cause(error), prepared.run_dir)) from error
    failure = recorded_failure(prepared.run_dir)
    if failure:
        raise TrainingFailed(failure)
    # The same source resume uses: Ray's result can lack a checkpoint it never registered.
    final = latest_checkpoint(prepared.run_dir)
    metrics = {**(result.metrics or {}), **reader_stats(reader)}
    extra = {
        key: metrics.get(key)
        for key in (
            "worker_node_ranks",
            "epoch_seconds",
            "epoch_steal",
            "first_step_at",
            "worker_peak_rss_bytes",
            "worker_startup_rss_bytes",
            "worker_model_state_bytes",
            "worker_comm_bytes_per_step",
            "checkpoint_stall_s",
        )
    }
    # The attempts whose work is in the model, as its last checkpoint recorded them.
    extra["world_sizes"] = final.world_sizes or None
    world_size = final.world_sizes[-1]["num_workers"] if final.world_sizes else scaling.num_workers
    return finish(prepared, final, metrics, world_size, {"scaling": asdict(scaling)}, extra)


def _trainer(loop: dict, **options) -> _Trainer:
    """The loop's config is bound to the function, not passed as ``train_loop_config``: Ray
    Train's controller unpickles that (for its run records), and it holds the model's wrapper and
    factory, whose modules import torch (with ``TorchConfig``'s, ~1.4 of the controller's 2.8
    CPU-seconds a fit, measured). The bound function reaches the workers through the object
    store, which the controller does not open."""
    return _Trainer(functools.partial(train_loop_per_worker, loop), **options)


def _drop_unreadable_registry(run_dir: str) -> None:
    """Ray Train's checkpoint registry, when a write cut it short (a full disk), fails every later
    fit of the run ("CheckpointManagerInitializationError: Expecting value"). raypar resumes from
    the checkpoint files themselves (``usable_checkpoints``), not from the registry: one that
    cannot be read is removed, said in one line, and Ray starts a new one."""
    path = storage.join(run_dir, REGISTRY_FILE)
    if not storage.exists(path):
        return
    try:
        json.loads(storage.read_bytes(path))
    except ValueError:
        print(
            f"[raypar] Ray Train's checkpoint registry {storage.without_query(path)} was cut short; removed "
            "(the checkpoints themselves are read, not the registry)",
            flush=True,
        )
        storage.delete_file(path)


def _process_group(scaling: WorkerScaling) -> ProcessGroupConfig:
    """Ray Train's default (nccl on GPUs, gloo on CPUs), except for workers that may share a GPU:
    gloo, said on one line. Not a refusal: fractional GPUs are how Ray packs small workers onto
    one device, a user asking for them wants that run, and gloo all-reduces the same float32
    gradients (the same model) through host memory, where nccl fails only after the workers
    started (57 s, measured) with "Duplicate GPU detected"."""
    largest = max((node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node.get("Alive")), default=0.0)
    shared = gpu_sharing(scaling.num_workers, scaling.resources_per_worker.get("GPU"), largest)
    if not shared:
        return ProcessGroupConfig()
    print(
        f"[raypar] {shared}; nccl cannot run two ranks on one GPU, so the workers all-reduce over gloo "
        "(through host memory, slower; --gpus-per-worker 1 gives each its own GPU and nccl)",
        flush=True,
    )
    return ProcessGroupConfig(backend="gloo")


def _request(strategy: str, flag: str, num_workers: int) -> Request:
    """The flags a preflight refusal can name: DataParallel's one worker takes its GPUs by --gpus."""
    if strategy == "dp":
        return Request("", 1, {"CPU": "--cpus-per-worker", "GPU": "--gpus"})
    return Request(flag, num_workers, {"CPU": "--cpus-per-worker", "GPU": "--gpus-per-worker"})


def _storage_options(storage_path: str) -> dict:
    """Ray's storage as raypar resolved it: a URI's query options (``endpoint_override``, ...)
    and environment (``AWS_ENDPOINT_URL``) reach Ray's checkpoint uploads through the filesystem."""
    if "://" not in storage_path:
        return {"storage_path": storage_path}
    filesystem, path = storage.resolve(storage_path)
    return {"storage_path": path, "storage_filesystem": filesystem}


class _Trainer(TorchTrainer):
    """``TorchTrainer`` less two actors it starts for every fit, each a process of its own
    (docs/performance.md):
    - a ``DatasetManager`` (~1.2 CPU-seconds): raypar hands Ray Train no dataset (the data travels
      through the object store or raypar's own reader), so there is nothing for it to serve;
    - on a local Ray this process started, the ``PlacementGroupCleaner`` (~1.6 CPU-seconds): it
      frees a run's placement group should the controller die unannounced, and that Ray, with
      every placement group on it, ends with this process anyway. On a cluster joined by address
      it stays."""

    def _create_default_callbacks(self):
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        dropped = (DatasetsCallback,) if not self.datasets else ()
        if ray_started_here():
            dropped += (PlacementGroupCleanerCallback,)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]


def _fit_interruptibly(trainer: TorchTrainer):
    """``fit()`` on a helper thread, stopped by ``interrupts.check()`` while it runs.

    On the main thread Ray Train would install its own SIGINT handler, whose graceful abort
    waits on the controller (which can be stuck retrying) and then exits with status 0.
    """
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # re-raised on the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, name="raypar-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        interrupts.check()
        thread.join(timeout=0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
