"""The static provider's machine list file."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.providers import Availability, Machine, MachineNotFound, ProviderUnsupported
from shepherd.providers.static import (
    MAX_FILE_SIZE,
    StaticFileError,
    StaticProvider,
    load_machines,
)

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


def test_oversized_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "machines.toml"
    with path.open("w") as f:
        f.write(GOOD)
        f.write("#" * MAX_FILE_SIZE + "\n")
    with pytest.raises(StaticFileError, match="larger than 4 MiB"):
        StaticProvider.from_file(path)


@pytest.mark.parametrize(
    "text",
    ["x = " + "[" * 5000 + "]" * 5000, "x = " + "{a = " * 5000 + "1" + "}" * 5000],
    ids=["arrays", "inline-tables"],
)
def test_deep_nesting_is_a_clear_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(StaticFileError, match="nested too deeply"):
        StaticProvider.from_file(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("entry", "line", "problem"),
    [
        ('id = "a\\u0000b"\naddress = "h"', 3, "machine id 'a\\x00b' must be printable"),
        ('id = "a\\u001b[2J"\naddress = "h"', 3, "must be printable"),
        ('id = "a\\nb"\naddress = "h"', 3, "must be printable"),
        (f'id = "{"x" * 300}"\naddress = "h"', 3, "at most 255 characters"),
        ('id = "a"\naddress = "-oProxyCommand=sh"', 4, "neither a host name nor an IP"),
        ('id = "a"\naddress = "host name"', 4, "neither a host name"),
        ('id = "a"\naddress = "h\\u0000"', 4, "neither a host name"),
        ('id = "a"\naddress = "10.0.0.1:22"', 4, "neither a host name"),
        ('id = "a"\naddress = "a..b"', 4, "neither a host name"),
    ],
)
def test_bad_ids_and_addresses_are_refused_with_line(
    tmp_path: Path, entry: str, line: int, problem: str
) -> None:
    path = _write(tmp_path, f"# comment\n[[machine]]\n{entry}\n")
    with pytest.raises(StaticFileError, match=re.escape(f"{path}:{line}: ")) as caught:
        StaticProvider.from_file(path)
    assert problem in str(caught.value)


@pytest.mark.parametrize("address", ["192.0.2.1", "2001:db8::1", "::1", "host", "a-b.example."])
def test_good_addresses_are_accepted(tmp_path: Path, address: str) -> None:
    path = _write(tmp_path, f'[[machine]]\nid = "a"\naddress = "{address}"\n')
    assert StaticProvider.from_file(path)._machines["a"].address == address


def test_empty_file_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shepherd.providers.static"):
        provider = StaticProvider.from_file(_write(tmp_path, "# nothing yet\n"))
    assert provider._machines == {}
    assert "lists no machines" in caplog.text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=300)
    | st.lists(
        st.sampled_from(
            [
                b"[[machine]]\n",
                b'id = "a"\n',
                b'id = "b"\n',
                b'address = "h"\n',
                b"address = 1\n",
                b"port = 70000\n",
                b"port = 22\n",
                b'location = "x"\n',
                b"[machine]\n",
                b"x = [[1]]\n",
                b'machine = {id = "a"}\n',
                b"\x00",
                b"\xff",
                b'"',
                b"[",
                b"=",
            ]
        ),
        max_size=12,
    ).map(b"".join)
)
def test_fuzz_any_bytes_load_or_fail_cleanly(data: bytes) -> None:
    """Whatever the file holds, the loader returns machines or a StaticFileError."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "machines.toml"
        path.write_bytes(data)
        try:
            machines = load_machines(path)
        except StaticFileError:
            return
    for machine in machines:
        assert machine.id.isprintable() and machine.address
