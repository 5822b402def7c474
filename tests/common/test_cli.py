"""common.cli: every CLI reports leaf errors as one line each, bugs with a traceback."""

from __future__ import annotations

import pytest
import trio

from common.cli import BROKEN_PIPE_STATUS, leaf_errors, run_main


class KnownError(Exception):
    pass


def test_leaf_errors_flattens_nested_groups_in_order() -> None:
    a, b, c = KnownError("a"), ValueError("b"), KnownError("c")
    group = ExceptionGroup("outer", [a, ExceptionGroup("inner", [b, ExceptionGroup("x", [c])])])
    assert leaf_errors(group) == [a, b, c]
    assert leaf_errors(a) == [a]


def test_known_errors_in_nested_groups_are_one_line_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def fail() -> None:
        async with trio.open_nursery() as outer:
            outer.start_soon(_nursery_raising, KnownError("first\nsecond line"))

    assert run_main("tool", lambda: trio.run(fail) or 0, known=(KnownError,)) == 1
    err = capsys.readouterr().err
    assert err == "tool: error: first; second line\n"


async def _nursery_raising(exc: BaseException) -> None:
    async def raise_it() -> None:
        raise exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(raise_it)


def test_unknown_errors_get_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_nursery_raising, KnownError("expected"))
            nursery.start_soon(_nursery_raising, ZeroDivisionError("oops"))

    assert run_main("tool", lambda: trio.run(both) or 0, known=(KnownError,)) == 1
    err = capsys.readouterr().err
    assert "tool: error: expected\n" in err
    assert "internal error" in err and "Traceback" in err and "ZeroDivisionError: oops" in err


def test_system_exit_propagates_from_a_group() -> None:
    def body() -> int:
        raise ExceptionGroup("g", [KnownError("x")]) from None

    def usage() -> int:
        raise BaseExceptionGroup("g", [SystemExit(2)])

    assert run_main("tool", body, known=(KnownError,)) == 1
    with pytest.raises(SystemExit):
        run_main("tool", usage, known=(KnownError,))


def test_broken_pipe_is_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    assert run_main("tool", body, known=(KnownError,)) == BROKEN_PIPE_STATUS
    assert capsys.readouterr().err == ""


def test_labels_name_where_an_error_came_from(capsys: pytest.CaptureFixture[str]) -> None:
    class ProviderTrouble(KnownError):
        pass

    def body() -> int:
        raise ExceptionGroup("g", [ProviderTrouble("404"), KnownError("other")])

    labels = [(ProviderTrouble, "Equinix")]
    assert run_main("tool", body, known=(KnownError,), labels=labels) == 1
    assert capsys.readouterr().err == "tool: Equinix: 404\ntool: error: other\n"
