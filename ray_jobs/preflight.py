"""Compare what a job asks for with what the cluster has, before anything waits on it."""
from __future__ import annotations

import ray


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
