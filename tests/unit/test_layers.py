"""The house's one rule of direction, read from the source (ast, no imports run): entry points
-> strategies -> driver -> observability, testing -> core -> data -> errors -> models.

A module imports only from its own room or from a room below it; the strategies never import each
other; the code that runs inside a Ray Train worker or a stage actor never reaches driver code,
even through another module; ``models`` and ``core`` import no Ray and no torch.distributed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Lower runs first: a room may import only rooms of a higher rank (or itself).
RANKS = {
    "entry": 0,
    "data_parallel": 1,
    "pipeline": 1,
    "predict": 1,
    "driver": 2,
    "observability": 3,
    "testing": 3,
    "core": 4,
    "data": 5,
    "errors": 6,
    "models": 7,
}
ENTRY_POINTS = {
    "ray_jobs.ddp",
    "ray_jobs.dp",
    "ray_jobs.fsdp",
    "ray_jobs.generate",
}  # plus every __main__ and the bench, a harness of entry points
# What runs inside a Ray Train worker, a stage actor or the stream's reader actor.
WORKER_SIDE = [
    "ray_jobs.data_parallel.worker",
    "ray_jobs.data_parallel.wrap",
    "ray_jobs.data_parallel.sharding",
    "ray_jobs.data_parallel.checkpointing",
    "ray_jobs.pipeline.stage",
    "ray_jobs.pipeline.replicas",
    "ray_jobs.data.stream",
    "ray_jobs.data.stream_plan",
]
NO_RAY_ROOMS = ("models", "core")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


GRAPH = {
    module_name(path): imports(path) for folder in ("ray_jobs", "models") for path in (REPO / folder).rglob("*.py")
}


def room(module: str) -> str | None:
    """The room a module of ours lives in (None: not ours)."""
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    if parts[0] != "ray_jobs" or len(parts) == 1:
        return None
    if module in ENTRY_POINTS or parts[-1] == "__main__" or parts[1] == "bench":
        return "entry"
    return parts[1] if parts[1] in RANKS else None


def ours(module: str) -> str | None:
    """``module`` as a module of the graph (``pkg.name`` may be a name imported from ``pkg``)."""
    while module and module not in GRAPH:
        module = module.rpartition(".")[0]
    return module or None


def test_every_room_is_ranked():
    rooms = {path.name for path in (REPO / "ray_jobs").iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert rooms - {"bench"} <= set(RANKS), rooms - set(RANKS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_run_down(module):
    mine = room(module)
    wrong = []
    for target in filter(None, map(ours, GRAPH[module])):
        theirs = room(target)
        if theirs is None or theirs == mine or mine is None:
            continue
        if RANKS[theirs] <= RANKS[mine]:
            wrong.append(f"{target} ({theirs})")
    assert not wrong, f"{module} ({mine}) imports up or sideways: {', '.join(sorted(set(wrong)))}"


def reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for target in filter(None, map(ours, GRAPH.get(current, ()))):
            # Importing a.b.c runs a/__init__ and a/b/__init__ too.
            parents = [".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 1)]
            todo += [target, *(parent for parent in parents if parent in GRAPH)]
    return seen


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_worker_side_never_reaches_driver_code(module):
    assert module in GRAPH
    driver = sorted(m for m in reachable(module) if room(m) in ("driver", "entry"))
    assert not driver, f"{module} runs in a worker or actor but imports {driver}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if room(m) in NO_RAY_ROOMS))
def test_models_and_core_use_no_ray(module):
    banned = sorted(
        name for name in GRAPH[module] if name.split(".")[0] == "ray" or name.startswith("torch.distributed")
    )
    assert not banned, f"{module} imports {banned}"


def test_the_data_command_line_imports_nothing_above_data():
    # As an entry point, data/__main__ passes test_imports_run_down whatever it imports; but writing training
    # data needs nothing above data (the parser it shares with core's flags lives in data for this).
    # Only `tokenize --ray` reaches up, to join a cluster as every entry point joins one.
    targets = set(filter(None, map(ours, GRAPH["ray_jobs.data.__main__"]))) - {"ray_jobs.driver.connect"}
    above = sorted({t for t in targets if room(t) in RANKS and RANKS[room(t)] < RANKS["data"]})
    assert not above, f"ray_jobs.data.__main__ imports {above}"
