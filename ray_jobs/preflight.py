"""Compare what a job asks for with what the cluster has, before anything waits on it."""
from __future__ import annotations

import time

import ray

# How often a wait for the autoscaler says what it is waiting for.
PROGRESS_EVERY_S = 10.0


class ResourceError(ValueError):
    """The cluster can never satisfy the request."""


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{value:g} {key}" for key, value in sorted(resources.items()))


def check_bundles(bundles: list[dict[str, float]], strategy: str, what: str) -> None:
    """Fail at once when ``bundles`` cannot be placed with ``strategy`` on the current nodes.

    Ray would otherwise keep the request pending forever on a fixed-size cluster.
    """
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    totals: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            totals[key] = totals.get(key, 0.0) + value
    asked: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            asked[key] = asked.get(key, 0.0) + value
    for key, value in asked.items():
        if totals.get(key, 0.0) + 1e-9 < value:
            raise ResourceError(
                f"{what} asks for {value:g} {key} in all; the cluster has {totals.get(key, 0.0):g} {key} "
                f"({len(nodes)} node(s): {_fmt({k: v for k, v in totals.items() if k in ('CPU', 'GPU', *asked)})})"
            )
    fits = [sum(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes) for bundle in bundles]
    if bundles and min(fits) == 0:
        raise ResourceError(f"{what}: no single node has {_fmt(bundles[fits.index(0)])} for one worker")
    if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        raise ResourceError(
            f"{what} with STRICT_SPREAD needs {len(bundles)} nodes; the cluster has {len(nodes)}"
        )
    if strategy == "STRICT_PACK":
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in asked.items()) for node in nodes):
            raise ResourceError(f"{what} with STRICT_PACK needs {_fmt(asked)} on one node; no node has that")


def wait_for_bundles(bundles: list[dict[str, float]], strategy: str, what: str, timeout_s: float) -> None:
    """``check_bundles``, but on an autoscaling cluster whose node types could provide the
    bundles, wait up to ``timeout_s`` for nodes to join instead of failing at once."""
    try:
        check_bundles(bundles, strategy, what)
        return
    except ResourceError as error:
        limits = autoscaling_limits()
        if not limits or not _within(bundles, limits):
            raise
        first_error = error
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)  # ask for the nodes now, not when Ray Train asks
    began = last_said = time.monotonic()
    try:
        while time.monotonic() - began < timeout_s:
            try:
                check_bundles(bundles, strategy, what)
                return
            except ResourceError as error:
                if time.monotonic() - last_said >= PROGRESS_EVERY_S:
                    print(f"[raypar] waiting for the autoscaler ({time.monotonic() - began:.0f}/{timeout_s:.0f} s): "
                          f"{error}", flush=True)
                    last_said = time.monotonic()
            time.sleep(1.0)
        raise ResourceError(f"{first_error}; waited {timeout_s:g} s (--resource-timeout) for the autoscaler")
    finally:
        request_resources(bundles=[])


def autoscaling_limits() -> dict[str, float] | None:
    """The most of each resource the autoscaler could provide, or None on a fixed-size cluster."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # a private API: treat any failure as "no autoscaler"
        return None


def _within(bundles: list[dict[str, float]], limits: dict[str, float]) -> bool:
    asked: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            asked[key] = asked.get(key, 0.0) + value
    return all(limits.get(key, 0.0) >= value for key, value in asked.items())
