"""Storage URIs: a run name joins the path, and a URI's query options stay in the query."""

from __future__ import annotations

from ray_jobs.data import storage


def test_run_names_go_into_the_path_and_options_stay_in_the_query():
    base = "s3://bucket/runs?endpoint_override=host:9000&scheme=http"
    assert (
        storage.join(base, "run", "model.pt") == "s3://bucket/runs/run/model.pt?endpoint_override=host:9000&scheme=http"
    )
    assert storage.join("s3://bucket/runs/", "run") == "s3://bucket/runs/run"
    assert storage.join("/local/runs", "a?b") == "/local/runs/a?b"  # a local path has no query
    assert storage.without_query(base) == "s3://bucket/runs"
