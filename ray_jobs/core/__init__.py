"""The training contract every strategy shares, with no Ray in it: the config (``config``, from its
flag groups ``config_data``, ``config_model``, ``config_training``, ``config_run``; ``flags``: the
``--flags`` generated from them), how a global batch is cut (``batches``), one optimizer step
(``step``), the initial weights (``model_init``), the one checkpoint format (``checkpoint``),
evaluation on ``--val-data`` (``evaluation``) and the record of why a run stopped
(``failure_record``).

Its code runs in every process that trains: the driver, each Ray Train worker, each pipeline
stage actor.
"""
