"""The node half's packages import one way: the role server runs consensus and
the curator, the curator uses consensus, consensus knows neither (see
ARCHITECTURE.md). Read as source, as tests/bmdb/test_layers.py does for the BMDB."""

from __future__ import annotations

from pathlib import Path

from tests.layering import package_modules, unit, upward

#: Each unit's layer; a unit may import only from lower layers, so two units
#: of one layer import neither each other. A unit is a module or a
#: subpackage with all its modules.
LAYERS = {
    "metropolis.errors": 0,
    "metropolis.pki": 1,
    "metropolis.event": 1,
    "metropolis.gather": 1,
    "metropolis.crashpoint": 1,
    "metropolis.supervisor": 1,
    # The wire messages and the node's disk: parameters files are written
    # atomically, and the disk keeps messages, so the two share a layer.
    "metropolis.proto": 2,
    "metropolis.localstorage": 2,
    "metropolis.identity": 3,
    # The etcd member and the RPC stack: neither knows the other.
    "metropolis.consensus": 4,
    "metropolis.rpc": 4,
    "metropolis.curator": 5,
    "metropolis.roleserve": 6,
    "metropolis.owner": 7,
    # The node image's builder, which the CLI's 'image' command runs...
    "metropolis.image": 7,
    "metropolis.demo": 8,
    # A loopback cluster of node processes, for benchmarks and tests.
    "metropolis.localcluster": 8,
    # The CLI's commands, each imported by the CLI when it runs.
    "metropolis.cli": 8,
    "metropolis.__main__": 9,
    "metropolis": 9,
    # ... and the image's entry point, which runs the CLI.
    "metropolis.image.entry": 10,
}

#: Two units of one layer that may import each other (a known pair).
TOGETHER = {frozenset({"metropolis.proto", "metropolis.localstorage"})}

ROOT = Path(__file__).resolve().parents[2] / "metropolis"


def _upward(layers: dict[str, int]) -> list[str]:
    # Generated protobuf code (metropolis/proto/gen) is left out.
    return upward(package_modules(ROOT, skip="gen"), layers, TOGETHER)


def test_every_module_has_a_layer() -> None:
    for name in package_modules(ROOT, skip="gen"):
        unit(name, LAYERS)  # KeyError names a module in no layer


def test_imports_only_go_down() -> None:
    assert not _upward(LAYERS), _upward(LAYERS)


def test_the_check_sees_the_role_server_use_consensus() -> None:
    # Were consensus above the role server, the role server's imports of it
    # would go up: the check reads the imports it is meant to judge.
    upside_down = LAYERS | {"metropolis.consensus": 7}
    assert any(
        line.startswith("metropolis.roleserve.") and "metropolis.consensus" in line
        for line in _upward(upside_down)
    )
