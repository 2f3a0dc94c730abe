"""Compare what a job asks for with what the cluster has, before anything waits on it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

# How often a wait for the autoscaler says what it is waiting for.
PROGRESS_EVERY_S = 10.0


class ResourceError(ValueError):
    """The cluster can never satisfy the request."""


@dataclass
class Request:
    """What a run asks Ray to place, named by the flags that set it, so every refusal can say
    which flag would make it fit."""

    count_flag: str
    """The flag that set the number of bundles (``--num-workers``, ``--num-stages``); empty for one."""
    count: int
    resource_flags: dict[str, str] = field(default_factory=dict)
    """Per resource, the flag that sets one bundle's share: ``{"CPU": "--cpus-per-worker"}``."""
    label: str = ""
    """What the bundles are, when the count flag alone does not say (a pipeline's R x S actors)."""

    @property
    def what(self) -> str:
        if self.label:
            return self.label
        return f"{self.count_flag} {self.count}" if self.count_flag else "the run"


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{value:g} {key}" for key, value in sorted(resources.items()))


def _fitting_share(available: float) -> float | None:
    """A round per-bundle share no larger than ``available``: whole units, else 0.5, 0.25, 0.1."""
    if available >= 1:
        return float(int(available))
    return next((share for share in (0.5, 0.25, 0.1) if share <= available), None)


def _total_hint(request: Request, key: str, value: float, total: float) -> str:
    """How to fit ``value`` of ``key`` in all into ``total``: a smaller share, fewer bundles, more nodes."""
    if total <= 0:
        return "add nodes that have it" + (" or drop --use-gpu" if key == "GPU" else "")
    per_bundle = value / request.count
    options = []
    share = _fitting_share(total / request.count)
    if key in request.resource_flags and share is not None:
        options.append(f"lower {request.resource_flags[key]} ({share:g} fits)")
    if request.count_flag and int(total // per_bundle) >= 1:
        options.append(f"lower {request.count_flag} ({int(total // per_bundle)} fit)")
    return " or ".join(options + ["add nodes"])


def check_bundles(
    bundles: list[dict[str, float]], strategy: str, request: Request, nodes: list[dict[str, float]] | None = None
) -> None:
    """Fail at once when ``bundles`` cannot be placed with ``strategy`` on the current nodes (each
    a dict of resources; default: the cluster's live nodes), naming the flag that would fix it.

    Ray would otherwise keep the request pending forever on a fixed-size cluster.
    """
    if nodes is None:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    what = request.what
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
            have = {k: v for k, v in totals.items() if k in ("CPU", "GPU", *asked)}
            raise ResourceError(
                f"{what} asks for {value:g} {key} in all; the cluster has {totals.get(key, 0.0):g} {key} "
                f"({len(nodes)} node(s): {_fmt(have)}): {_total_hint(request, key, value, totals.get(key, 0.0))}"
            )
    fits = [sum(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes) for bundle in bundles]
    if bundles and min(fits) == 0:
        bundle = bundles[fits.index(0)]
        short = [k for k, v in bundle.items() if max((node.get(k, 0.0) for node in nodes), default=0.0) + 1e-9 < v]
        hints = [
            f"lower {request.resource_flags.get(k, k)} to at most "
            f"{max((node.get(k, 0.0) for node in nodes), default=0.0):g}"
            for k in short
        ]
        raise ResourceError(
            f"{what}: no single node has {_fmt(bundle)} for one of them: {' and '.join(hints) or 'add a larger node'}"
        )
    if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        raise ResourceError(
            f"{what} with STRICT_SPREAD needs {len(bundles)} nodes; the cluster has {len(nodes)}: "
            "use --placement-strategy SPREAD or add nodes"
        )
    if strategy == "STRICT_PACK":
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in asked.items()) for node in nodes):
            raise ResourceError(
                f"{what} with STRICT_PACK needs {_fmt(asked)} on one node; no node has that: "
                "use --placement-strategy PACK or add a larger node"
            )


def wait_for_bundles(bundles: list[dict[str, float]], strategy: str, request: Request, timeout_s: float) -> None:
    """``check_bundles``, but on an autoscaling cluster whose node types could provide the
    bundles, wait up to ``timeout_s`` for nodes to join instead of failing at once."""
    try:
        check_bundles(bundles, strategy, request)
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
                check_bundles(bundles, strategy, request)
                return
            except ResourceError as error:
                if time.monotonic() - last_said >= PROGRESS_EVERY_S:
                    print(
                        f"[raypar] waiting for the autoscaler ({time.monotonic() - began:.0f}/{timeout_s:.0f} s): "
                        f"{error}",
                        flush=True,
                    )
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


def gpu_sharing(
    num_processes: int,
    gpus_each: float | None,
    gpus_per_node: float | None = None,
    what: str = "--num-workers",
    flag: str = "--gpus-per-worker",
) -> str | None:
    """Why ``num_processes`` processes of one run, each asking for ``gpus_each`` GPUs (None: no
    GPU), may find two of them on one device, or None when they cannot. nccl refuses two ranks on
    one device ("Duplicate GPU detected"), so such a run needs gloo between its processes.

    Ray gives a request of one GPU or more whole devices of its own; a fraction is a share of
    one device, and Ray packs fractions onto a device while they fit, so two processes can meet
    on one GPU exactly when two fractions fit on one (``gpus_each`` at most 0.5), whatever the
    nodes' sizes. ``gpus_per_node`` (the largest node's GPUs, when known) only says whether
    they must: more processes than a node's GPUs cannot each have a device of their own there.
    """
    if not gpus_each or num_processes < 2 or gpus_each >= 1 or gpus_each > 0.5:
        return None
    asked = f"{what} {num_processes} with {flag} {gpus_each:g}"
    if gpus_per_node is not None and num_processes > gpus_per_node:
        return f"{asked} on nodes of {gpus_per_node:g} GPU: they share GPUs"
    return f"{asked}: Ray packs fractions onto one GPU, so they may share one"
