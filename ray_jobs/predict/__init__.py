"""Batch prediction with a finished run's model: ``python -m ray_jobs.predict``.

``job`` (its flags and checks) runs in the user's process; ``inference`` builds the Ray Data
pipeline whose actor pool runs the model, each actor in its own process.
"""
