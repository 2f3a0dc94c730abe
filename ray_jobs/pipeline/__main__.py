"""``python -m ray_jobs.pipeline``: the pipeline strategy's entry point."""

from ray_jobs.driver.entry import exit_process
from ray_jobs.pipeline.trainer import main

exit_process(main())
