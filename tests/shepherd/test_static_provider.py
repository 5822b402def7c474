"""The static provider's machine list file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shepherd.providers import Availability, Machine, MachineNotFound, ProviderUnsupported
from shepherd.providers.static import StaticFileError, StaticProvider

GOOD = """\
# Two racks.
[[machine]]
id = "rack1-01"
address = "192.0.2.10"

[[machine]]
id = "rack1-02"
address = "rack1-02.example"
port = 2222
location = "fra1"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "machines.toml"
    path.write_text(text)
    return path


async def test_lists_and_gets_machines(tmp_path: Path) -> None:
    provider = StaticProvider.from_file(_write(tmp_path, GOOD))
    assert provider.type == "Static"
    first = Machine("rack1-01", "192.0.2.10", 22, None, Availability.KNOWN_UNUSED)
    second = Machine("rack1-02", "rack1-02.example", 2222, "fra1", Availability.KNOWN_UNUSED)
    assert await provider.list_machines() == [first, second]
    assert await provider.get_machine("rack1-02") == second
    with pytest.raises(MachineNotFound, match="no machine 'rack1-03'"):
        await provider.get_machine("rack1-03")
    assert provider.capabilities == frozenset()
    with pytest.raises(ProviderUnsupported):
        await provider.create_machine("slot")
    assert await provider.creation_slots() == []
    with pytest.raises(ProviderUnsupported, match="has no BMC"):
        await provider.reboot("rack1-01")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            GOOD + '[[machine]]\nid = "x"\nadress = "192.0.2.1"\n',
            r":13: unknown field 'adress' in machine #3 \(known fields: address, bmc, id,",
        ),
        (GOOD + '[[machine]]\nid = "x"\n', r":11: machine #3 lacks required 'address'"),
        (GOOD + '[[machine]]\nid = "x"\naddress = "a"\nport = "22"\n', r":14: field 'port' must"),
        (GOOD + '[[machine]]\nid = "x"\naddress = "a"\nport = true\n', r":14: field 'port' must"),
        (GOOD + '[[machine]]\nid = "x"\naddress = "a"\nport = 70000\n', r":14: port 70000 out"),
        (
            GOOD + '[[machine]]\nid = "rack1-01"\naddress = "a"\n',
            r":12: duplicate machine id 'rack1-01' \(first at line 3\)",
        ),
        ('machines = []\n[[machine]]\nid = "x"\naddress = "a"\n', r":1: unknown top-level key"),
        (GOOD + "[[machine]\n", r"machines.toml: .*line 11"),
        (GOOD + '[[machine]]\nid = ""\naddress = "a"\n', r":11: machine #3 lacks required 'id'"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path: Path, text: str, error: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(StaticFileError, match=error) as caught:
        StaticProvider.from_file(path)
    assert str(caught.value).startswith(str(path))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StaticFileError, match="cannot read machine list"):
        StaticProvider.from_file(tmp_path / "nope.toml")
