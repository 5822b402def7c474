"""Talking to a machine's BMC over Redfish: read its power state, power-cycle it.

A BMC is named by the URL of its ComputerSystem resource,
``https://host:port/redfish/v1/Systems/ID``; :func:`parse_system_url` refuses
anything else at load time (so that a typo is an error at start, not a 404
at the first reboot). Credentials never come with the URL: they are looked up
per machine in :class:`BMCCredentials` (a separate file, or the environment;
see :func:`load_credentials`).

Only two Redfish operations are used, both defined by DMTF's ComputerSystem
schema: ``GET`` the system (``PowerState``, ``Actions``) and ``POST`` its
``#ComputerSystem.Reset`` target with a ``ResetType`` the system advertises.
Every failure is a :class:`BMCError` naming the URL and what went wrong (the
BMC's own message where it sent one), so a caller can fail that one machine
and go on.
"""

from __future__ import annotations

import logging
import os
import ssl
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shepherd.providers.base import PowerState, ProviderError, describe

logger = logging.getLogger("shepherd.providers.redfish")

#: Environment variables holding the credentials used for every BMC that the
#: credentials file does not name.
USERNAME_ENV = "SHEPHERD_BMC_USERNAME"
PASSWORD_ENV = "SHEPHERD_BMC_PASSWORD"

#: Reset types in order of preference for a power cycle of a running system.
#: ``PowerCycle`` is the real thing; many BMCs (and sushy-tools) only offer
#: ``ForceRestart``, which is what a recoverer wants from a hung machine too.
_CYCLE_RESET_TYPES = ("PowerCycle", "ForceRestart")


class BMCError(ProviderError):
    """A BMC could not be reached, refused us, or answered nonsense."""


class BMCConfigError(ProviderError):
    """A BMC URL or a credentials file is invalid. The message says where."""


def parse_system_url(text: str) -> str:
    """Check that ``text`` is a Redfish ComputerSystem URL and return it normalised.

    Raises :class:`BMCConfigError` for anything else: a scheme other than
    http(s), user info in the URL (credentials do not belong in the machines
    file), or a path other than ``/redfish/v1/Systems/<id>``.
    """
    url = urllib.parse.urlsplit(text)
    want = "want http(s)://host[:port]/redfish/v1/Systems/<id>"
    if url.scheme not in ("http", "https") or not url.hostname:
        raise BMCConfigError(f"BMC URL {text!r} is not a Redfish system URL: {want}")
    if url.username is not None or url.password is not None:
        raise BMCConfigError(
            f"BMC URL for host {url.hostname!r} contains credentials; "
            "put them in the BMC credentials file or the environment instead"
        )
    try:
        url.port  # noqa: B018 (validates the port)
    except ValueError as exc:
        raise BMCConfigError(f"BMC URL {text!r}: {exc}") from None
    parts = url.path.rstrip("/").split("/")
    if len(parts) != 5 or parts[:4] != ["", "redfish", "v1", "Systems"] or not parts[4]:
        raise BMCConfigError(f"BMC URL {text!r} is not a Redfish system URL: {want}")
    if url.query or url.fragment:
        raise BMCConfigError(f"BMC URL {text!r} must not have a query or fragment")
    return urllib.parse.urlunsplit((url.scheme, url.netloc, url.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class Credentials:
    """A BMC user name and password. The password stays out of ``repr``."""

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class BMCCredentials:
    """Credentials per machine id, with a fallback for the others."""

    per_machine: Mapping[str, Credentials] = field(default_factory=dict)
    default: Credentials | None = None

    def for_machine(self, machine_id: str) -> Credentials | None:
        return self.per_machine.get(machine_id, self.default)


def load_credentials(path: Path | None, environ: Mapping[str, str] = os.environ) -> BMCCredentials:
    """Read BMC credentials from ``path`` (TOML) and the environment.

    File format (keep it mode 0600; it is never the machines file)::

        [default]                 # optional: every machine not named below
        username = "admin"
        password = "..."

        [machine."rack1-01"]      # optional: one machine's own credentials
        username = "root"
        password = "..."

    ``SHEPHERD_BMC_USERNAME`` and ``SHEPHERD_BMC_PASSWORD`` give the default
    when the file has none. Raises :class:`BMCConfigError` naming the file.
    """
    default: Credentials | None = None
    per_machine: dict[str, Credentials] = {}
    if path is not None:
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise BMCConfigError(f"{path}: cannot read BMC credentials: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise BMCConfigError(f"{path}: {exc}") from exc
        for key in document:
            if key not in ("default", "machine"):
                raise BMCConfigError(f"{path}: unknown key {key!r}, want [default] or [machine.ID]")
        if "default" in document:
            default = _credentials(path, "default", document["default"])
        machines = document.get("machine", {})
        if not isinstance(machines, dict):
            raise BMCConfigError(f"{path}: 'machine' must be a table of [machine.ID] tables")
        for machine_id, table in machines.items():
            per_machine[machine_id] = _credentials(path, f"machine.{machine_id}", table)
    if default is None and (USERNAME_ENV in environ or PASSWORD_ENV in environ):
        if USERNAME_ENV not in environ or PASSWORD_ENV not in environ:
            raise BMCConfigError(f"set both {USERNAME_ENV} and {PASSWORD_ENV}, or neither")
        default = Credentials(environ[USERNAME_ENV], environ[PASSWORD_ENV])
    return BMCCredentials(per_machine, default)


def _credentials(path: Path, where: str, table: Any) -> Credentials:
    if not isinstance(table, dict):
        raise BMCConfigError(f"{path}: [{where}] must be a table")
    unknown = set(table) - {"username", "password"}
    if unknown:
        raise BMCConfigError(f"{path}: [{where}]: unknown keys {sorted(unknown)}")
    username, password = table.get("username"), table.get("password")
    if not isinstance(username, str) or not isinstance(password, str) or not username:
        raise BMCConfigError(f"{path}: [{where}] needs string 'username' and 'password'")
    return Credentials(username, password)


class RedfishClient:
    """Redfish over one pooled httpx client. Use as an async context manager.

    ``timeout`` bounds each request (connect, read). ``verify`` is passed to
    httpx (True: system CAs; a path: that CA bundle; False: no check, for
    BMCs with self-signed certificates on a trusted network). Cancellation
    aborts the request in flight; a reset already received by the BMC is not
    undone.
    """

    def __init__(self, *, timeout: float = 10.0, verify: bool | str = True) -> None:
        tls: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        )
        self._http = httpx.AsyncClient(timeout=timeout, verify=tls)

    async def __aenter__(self) -> RedfishClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, url: str, credentials: Credentials | None, body: Any = None
    ) -> Any:
        auth = (credentials.username, credentials.password) if credentials else None
        try:
            response = await self._http.request(method, url, auth=auth, json=body)
        except httpx.HTTPError as exc:
            raise BMCError(f"BMC {url}: {type(exc).__name__}: {describe(exc)}") from exc
        if response.status_code in (401, 403):
            who = f"user {credentials.username!r}" if credentials else "no credentials"
            raise BMCError(
                f"BMC {url}: {response.status_code} {response.reason_phrase}: "
                f"{_message(response)} ({who})"
            )
        if response.status_code >= 400:
            raise BMCError(
                f"BMC {url}: {response.status_code} {response.reason_phrase}: {_message(response)}"
            )
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise BMCError(f"BMC {url}: response is not JSON: {exc}") from exc

    async def _system(self, url: str, credentials: Credentials | None) -> dict[str, Any]:
        system = await self._request("GET", url, credentials)
        if not isinstance(system, dict):
            raise BMCError(f"BMC {url}: ComputerSystem is not a JSON object")
        return system

    async def power_state(self, url: str, credentials: Credentials | None) -> PowerState:
        """The system's ``PowerState``; :class:`BMCError` on any failure."""
        system = await self._system(url, credentials)
        value = system.get("PowerState")
        try:
            return PowerState(value)
        except ValueError:
            raise BMCError(f"BMC {url}: unknown PowerState {value!r}") from None

    async def reset(self, url: str, credentials: Credentials | None, reset_type: str) -> None:
        """POST ``ComputerSystem.Reset`` with ``reset_type``, if the system offers it."""
        system = await self._system(url, credentials)
        target, allowed = _reset_action(url, system)
        if allowed is not None and reset_type not in allowed:
            raise BMCError(f"BMC {url}: reset type {reset_type!r} not offered (offers {allowed})")
        await self._request("POST", target, credentials, {"ResetType": reset_type})

    async def power_cycle(self, url: str, credentials: Credentials | None) -> str:
        """Power-cycle the system (or power it on if it is off); returns the reset type used.

        Picks ``PowerCycle``, else ``ForceRestart``, from the system's
        advertised reset types; ``On`` for a system that is off.
        """
        system = await self._system(url, credentials)
        target, allowed = _reset_action(url, system)
        if system.get("PowerState") == PowerState.OFF.value:
            choices: tuple[str, ...] = ("On", "ForceOn")
        else:
            choices = _CYCLE_RESET_TYPES
        if allowed is None:
            reset_type = choices[-1]
        else:
            offered = [c for c in choices if c in allowed]
            if not offered:
                raise BMCError(f"BMC {url}: none of {list(choices)} offered (offers {allowed})")
            reset_type = offered[0]
        await self._request("POST", target, credentials, {"ResetType": reset_type})
        logger.info("BMC %s: %s requested", url, reset_type)
        return reset_type


def _reset_action(url: str, system: dict[str, Any]) -> tuple[str, list[str] | None]:
    """The Reset action's absolute target URL and its allowed reset types (None: not said)."""
    action = (system.get("Actions") or {}).get("#ComputerSystem.Reset")
    if not isinstance(action, dict) or not isinstance(action.get("target"), str):
        raise BMCError(f"BMC {url}: system has no #ComputerSystem.Reset action")
    allowed = action.get("ResetType@Redfish.AllowableValues")
    if allowed is not None and not (
        isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)
    ):
        raise BMCError(f"BMC {url}: malformed ResetType@Redfish.AllowableValues")
    return urllib.parse.urljoin(url, action["target"]), allowed


def _message(response: httpx.Response) -> str:
    """The Redfish error message of a response (``error.message``), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or "(empty body)"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        extended = error.get("@Message.ExtendedInfo")
        if isinstance(extended, list) and extended and isinstance(extended[0], dict):
            return str(extended[0].get("Message") or error.get("message"))
        return str(error.get("message"))
    return response.text[:200]
