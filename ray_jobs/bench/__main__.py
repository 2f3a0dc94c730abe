from ray_jobs.bench.run import main
from ray_jobs.driver.entry import exit_process

if __name__ == "__main__":
    exit_process(main())
