"""Batch prediction with a finished run's model: ``python -m ray_jobs.predict``.

``job`` (its flags and checks) and ``trained`` (a run's model record, read as data and checked
before any code it names runs) run in the user's process, ``TrainedModel.load`` in each actor
too; ``inference`` builds the Ray Data pipeline whose actor pool runs the model, each actor in
its own process. ``generate`` (``python -m ray_jobs.generate``) samples text from a language-model
run in the user's process alone: no Ray.
"""
