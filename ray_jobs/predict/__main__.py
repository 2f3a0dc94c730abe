"""``python -m ray_jobs.predict``: batch prediction's entry point."""

from ray_jobs.driver.entry import exit_process
from ray_jobs.predict.job import main

exit_process(main())
