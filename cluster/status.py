"""``status``, and asking the cluster's dashboard what Ray sees (nodes, actors), with its token."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path

from cluster.state import UserError, group_alive, require_state


def status(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    state = require_state(state_dir)
    if not any(group_alive(node) for node in state["nodes"]):
        raise UserError(
            f"the cluster recorded in {state_dir} is not running; clear it with: python -m cluster.local down"
        )
    try:
        nodes = fetch_nodes(state)
    except OSError as error:
        raise UserError(f"cannot reach {state['dashboard_url']}: {error}") from None
    print(f"address {state['address']}  dashboard {state['dashboard_url']}  token file {state['token_path']}")
    print(f"{'node ip':<12} {'head':<5} {'state':<6} resources")
    for node in sorted(nodes, key=lambda n: tuple(int(p) for p in n["node_ip"].split("."))):
        head = "yes" if node["is_head_node"] else ""
        print(f"{node['node_ip']:<12} {head:<5} {node['state']:<6} {format_resources(node['resources_total'])}")
    return 0


def fetch_nodes(state: dict, what: str = "nodes") -> list[dict]:
    """Nodes (or ``what`` else Ray's state API lists: ``actors``, ...), asked with the cluster's token."""
    token = Path(state["token_path"]).read_text().strip()
    request = urllib.request.Request(
        f"{state['dashboard_url']}/api/v0/{what}?limit=1000", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        raise UserError(f"{state['dashboard_url']} answered {error.code} {error.reason}") from None
    return body["data"]["result"]["result"]


def format_resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "object_store_memory", "memory"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(shown.items()))
