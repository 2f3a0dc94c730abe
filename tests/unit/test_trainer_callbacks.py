"""The Ray Train trainer raypar builds: what it starts per fit."""

from __future__ import annotations

from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from ray_jobs.data_parallel.trainer import _Trainer


def test_a_fit_without_a_ray_dataset_starts_no_dataset_manager():
    """Ray Train starts a DatasetManager actor per fit for its datasets; raypar passes none, so
    its trainer leaves the callback that starts it out (one process and ~1.2 CPU-seconds a fit)."""
    trainer = _Trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    kinds = {type(callback) for callback in trainer._create_default_callbacks()}
    assert DatasetsCallback not in kinds and len(kinds) > 2  # the others kept


def test_the_placement_group_cleaner_goes_only_on_a_ray_this_process_started(monkeypatch):
    """The cleaner frees a run's placement group if its controller dies unannounced: needed on a
    cluster joined by address, not on a local Ray that ends with this process."""
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from ray_jobs.data_parallel import trainer as module

    for started_here in (False, True):
        monkeypatch.setattr(module, "ray_started_here", lambda started_here=started_here: started_here)
        trainer = _Trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
        kinds = {type(callback) for callback in trainer._create_default_callbacks()}
        assert (PlacementGroupCleanerCallback in kinds) is not started_here


def test_what_ray_trains_controller_unpickles_imports_no_torch():
    """Ray Train starts a controller process per fit; torch in it cost ~1.4 of its 2.8
    CPU-seconds. The loop's config (which holds torch objects) must reach only the workers."""
    import functools

    import torch
    from ray import cloudpickle

    from ray_jobs.data_parallel.process_group import ProcessGroupConfig
    from ray_jobs.data_parallel.trainer import _trainer
    from tests.helpers import modules_after

    trainer = _trainer(
        {"wrap": torch.nn.Linear},
        torch_config=ProcessGroupConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2),
    )
    controller_inputs = cloudpickle.dumps((trainer.train_run_context, trainer._create_default_callbacks()))
    assert isinstance(trainer.train_loop_per_worker, functools.partial)
    assert "torch" not in modules_after("import pickle; pickle.loads(sys.stdin.buffer.read())", controller_inputs)
