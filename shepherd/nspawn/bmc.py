"""A Redfish BMC for the nspawn machines, so they are powered like real servers.

Why not sushy-tools: its drivers are fake (in memory), libvirt, Nova and
Ironic, none of which runs a container, and it is a Flask process of its own
while the machines' processes belong to the fleet's Trio process. Why here
and not in the tests: the demo and the benchmarks power these machines too,
and they may not import the tests.

It speaks what sushy-tools speaks and `shepherd.providers.redfish` uses,
with HTTP basic auth (one user)::

    GET  /redfish/v1/                         the service root
    GET  /redfish/v1/Systems                  the collection
    GET  /redfish/v1/Systems/{id}             Id, Name, UUID, PowerState, Actions
    POST /redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset   {"ResetType": ...}

Reset types (answered 204 at once; the change then takes its time, as on a
real BMC): ``On``/``ForceOn`` start the machine, ``ForceOff`` cuts its
power, ``GracefulShutdown`` is an orderly poweroff, ``GracefulRestart`` an
orderly reboot, ``ForceRestart`` a cut then on (`shepherd.nspawn.machine`).
``PowerState`` is ``On`` from nspawn's start to its exit, so it stays ``On``
through a reboot asked from inside. Errors are Redfish error bodies: 400
for a bad body or reset type, 401 without the right credentials, 404 for
an unknown system or path, 405 for another method.

Served by hypercorn's Trio worker (`serve_bmc`), on the host's loopback.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from common.asgi import answer_lifespan
from shepherd.nspawn.machine import Machine, Power

__all__ = ["RESET_TYPES", "bmc_app", "serve_bmc"]

logger = logging.getLogger("shepherd.nspawn.bmc")

#: The reset types offered, in sushy-tools' order (no Nmi: a container has none).
RESET_TYPES = ("On", "ForceOff", "GracefulShutdown", "GracefulRestart", "ForceRestart", "ForceOn")
_MAX_BODY = 4096

Message = Mapping[str, Any]


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {
        "error": {
            "code": "Base.1.0.GeneralError",
            "message": message,
            "@Message.ExtendedInfo": [{"Message": message}],
        }
    }


def _system(system_id: str, machine: Machine) -> dict[str, Any]:
    base = f"/redfish/v1/Systems/{system_id}"
    return {
        "@odata.type": "#ComputerSystem.v1_10_0.ComputerSystem",
        "@odata.id": base,
        "Id": system_id,
        "Name": machine.spec.hostname,
        "UUID": machine.spec.name,
        "PowerState": machine.power.value,
        "Actions": {
            "#ComputerSystem.Reset": {
                "target": f"{base}/Actions/ComputerSystem.Reset",
                "ResetType@Redfish.AllowableValues": list(RESET_TYPES),
            }
        },
    }


def bmc_app(
    machines: Mapping[str, Machine],
    username: str,
    password: str,
    nursery: trio.Nursery,
) -> Callable[..., Awaitable[None]]:
    """The ASGI app serving ``machines`` (by system id). Power changes run
    in ``nursery``, so a request returns before a machine is off or booted."""
    expected = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()

    async def reset(system_id: str, machine: Machine, reset_type: str) -> None:
        try:
            if reset_type in ("On", "ForceOn"):
                await machine.power_on()
            elif reset_type == "ForceOff":
                await machine.force_off()
            elif reset_type == "GracefulShutdown":
                await machine.shutdown()
            elif reset_type == "GracefulRestart":
                if machine.power is Power.ON:
                    machine.graceful_restart()
            elif reset_type == "ForceRestart":
                await machine.force_restart()
        except Exception:
            logger.exception("BMC: %s of %s failed", reset_type, system_id)

    async def handle(method: str, path: str, body: bytes) -> tuple[int, dict[str, Any] | None]:
        parts = path.rstrip("/").split("/")
        if parts[:3] != ["", "redfish", "v1"]:
            return _error(404, f"no resource at {path}")
        rest = parts[3:]
        if rest == [] and method == "GET":
            return 200, {
                "@odata.id": "/redfish/v1/",
                "Id": "RootService",
                "RedfishVersion": "1.6.0",
                "Systems": {"@odata.id": "/redfish/v1/Systems"},
            }
        if rest == ["Systems"] and method == "GET":
            return 200, {
                "@odata.id": "/redfish/v1/Systems",
                "Members@odata.count": len(machines),
                "Members": [{"@odata.id": f"/redfish/v1/Systems/{i}"} for i in machines],
            }
        if len(rest) < 2 or rest[0] != "Systems" or rest[1] not in machines:
            return _error(404, f"no resource at {path}")
        system_id, machine = rest[1], machines[rest[1]]
        if len(rest) == 2:
            if method != "GET":
                return _error(405, f"{method} not allowed on {path}")
            return 200, _system(system_id, machine)
        if rest[2:] != ["Actions", "ComputerSystem.Reset"]:
            return _error(404, f"no resource at {path}")
        if method != "POST":
            return _error(405, f"{method} not allowed on {path}")
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body is not JSON")
        reset_type = request.get("ResetType") if isinstance(request, dict) else None
        if reset_type not in RESET_TYPES:
            return _error(400, f"ResetType {reset_type!r} not one of {list(RESET_TYPES)}")
        logger.info("BMC: %s of %s", reset_type, system_id)
        nursery.start_soon(reset, system_id, machine, reset_type)
        return 204, None

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = b""
        status: int
        answer: dict[str, Any] | None
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > _MAX_BODY:
                status, answer = _error(413, "body too large")
                break
            if not message.get("more_body"):
                headers = dict(scope["headers"])
                given = headers.get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    status, answer = _error(401, "authentication required")
                else:
                    status, answer = await handle(scope["method"], scope["path"], body)
                break
        headers_out = [(b"odata-version", b"4.0")]
        if status == 401:
            headers_out.append((b"www-authenticate", b'Basic realm="nspawn BMC"'))
        payload = b"" if answer is None else json.dumps(answer).encode()
        if answer is not None:
            headers_out.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": headers_out})
        await send({"type": "http.response.body", "body": payload})

    return app


async def serve_bmc(
    machines: Mapping[str, Machine],
    username: str,
    password: str,
    listen: str = "127.0.0.1:0",
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the BMC on ``listen`` until cancelled; ``task_status.started``
    gets its base URL (``http://127.0.0.1:PORT``). Raises OSError if the
    address cannot be bound. Power changes still running when it is
    cancelled are cancelled with it."""
    config = Config()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("shepherd.nspawn.bmc.hypercorn")
    async with trio.open_nursery() as nursery:
        app = cast(ASGIFramework, bmc_app(machines, username, password, nursery))

        async def run(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve(app, config, mode="asgi", task_status=task_status)

        urls: list[str] = await nursery.start(run)
        task_status.started(urls[0])
