"""The data-parallel strategies on Ray Train workers: DistributedDataParallel (``ddp``) and the
``nn.DataParallel`` baseline (``dp``).

``trainer`` runs on the driver: it sets up Ray Train's ``TorchTrainer`` (scaling, process group,
storage, failures) and turns its result into the run's outputs. ``worker`` is the loop each Ray
Train worker process runs; it and ``wrap`` (how each strategy wraps the model) run in the workers
and import no driver code.
"""
