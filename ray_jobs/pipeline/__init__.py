"""The pipeline (model-parallel) strategy: the model cut into stages, each a Ray actor.

Driver side: ``trainer`` (attempts, epochs, checkpoints; ``python -m ray_jobs.pipeline``),
``scaling`` (its flags), ``cut`` (where the model is cut), ``stage_group`` (placing, starting and
probing the actors), ``timing``. Actor side: ``stage`` (a ``StageWorker``: one slice of the model
and its optimizer), which imports no driver code. Both sides use ``schedules`` (GPipe, 1F1B) and
``transports`` (p2p send/recv, a compiled graph, or actor calls).
"""
