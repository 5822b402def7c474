"""A local Equinix Metal API server, for tests, the demo and the benchmark.

Not a mock of our client: an HTTP/1.1 server (h11 on Trio sockets) serving
the paths and JSON shapes of the real API (``https://api.equinix.com/metal/v1``)
that the Shepherd uses, with the real API's behaviour where it matters to a
client: ``X-Auth-Token`` authentication, paging with ``meta.next``, errors
as ``{"errors": [...]}`` with 401/404/422, devices that are ``provisioning``
for a while after creation and then ``active``, and hardware reservations
that stop being provisionable once they hold a device. Paths::

    GET    /projects/{project}/devices?page=&per_page=
    POST   /projects/{project}/devices
    GET    /devices/{id}
    POST   /devices/{id}/actions               {"type": "reboot" | ...}
    GET    /projects/{project}/hardware-reservations?page=&per_page=
    GET    /hardware-reservations/{id}
    GET    /projects/{project}/ssh-keys        POST /projects/{project}/ssh-keys
    GET    /ssh-keys/{id}                      PATCH /ssh-keys/{id}

Failures are injected per request pattern with :meth:`LocalEquinix.inject`
(a status with an optional ``Retry-After``, a delay, a malformed body, or a
dropped connection), so tests see what a client does with them. The state
is in memory and inspectable (``devices``, ``reservations``, ``ssh_keys``,
``requests``).

Run it alone with ``python -m shepherd.providers.equinix.localserver
--reservations 30 [--devices N]`` (prints the URL, project id and token).
"""

from __future__ import annotations

import argparse
import datetime
import http
import itertools
import json
import logging
import re
import secrets
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from shepherd.errors import ShepherdError

logger = logging.getLogger("shepherd.providers.equinix.localserver")

JSON = dict[str, Any]


@dataclass
class Fault:
    """What to do instead of (or before) answering a matching request."""

    #: Answer with this status and ``{"errors": [message]}`` (None: answer normally).
    status: int | None = None
    message: str = "injected failure"
    #: ``Retry-After`` header value (seconds) on the error answer.
    retry_after: float | None = None
    #: Sleep this long before handling the request (with ``after``: after
    #: handling it, before answering: a client that dies meanwhile never
    #: learns that its request succeeded).
    delay: float = 0.0
    #: Answer 200 with this body (not JSON) instead of the real answer.
    malformed: bytes | None = None
    #: Close the connection without answering (after handling the request,
    #: when ``after`` is set: a create that happened but whose answer was lost).
    drop: bool = False
    #: Apply ``drop`` and ``delay`` after the request was handled.
    after: bool = False


@dataclass
class _Injection:
    method: str
    path: re.Pattern[str]
    fault: Fault
    remaining: int


@dataclass
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    status: int


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _iso(at: datetime.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


class _HTTPError(ShepherdError):
    """An API error answer; never escapes the server (it becomes the response)."""

    def __init__(self, status: int, *messages: str) -> None:
        super().__init__(status, messages)
        self.status = status
        self.messages = list(messages)


@dataclass
class LocalEquinix:
    """The API's state and its HTTP server. Start with :meth:`serve` in a nursery."""

    project_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    #: Seconds a new device stays ``provisioning`` before it is ``active``.
    provisioning_delay: float = 0.0
    #: Largest page the server hands out, whatever ``per_page`` asks for.
    max_per_page: int = 1000
    facility: str = "fr2"
    #: Public IPv4 address given to the n-th device created (n from 0); None:
    #: the device has no public IPv4 (then it gets only an IPv6 address).
    ipv4_for: Callable[[int], str | None] = lambda n: f"198.51.{n // 250}.{n % 250 + 1}"

    devices: dict[str, JSON] = field(default_factory=dict)
    reservations: dict[str, JSON] = field(default_factory=dict)
    ssh_keys: dict[str, JSON] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._injections: list[_Injection] = []
        self._created = itertools.count()
        self._ready_at: dict[str, float] = {}

    # State set up by tests.

    def add_reservations(self, count: int, plan: str = "c3.small.x86") -> list[str]:
        """Add ``count`` free, provisionable hardware reservations; return their ids."""
        ids = []
        for _ in range(count):
            rid = str(uuid.uuid4())
            self.reservations[rid] = {
                "id": rid,
                "href": f"/metal/v1/hardware-reservations/{rid}",
                "provisionable": True,
                "spare": False,
                "device": None,
                "plan": {"slug": plan, "name": plan},
                "facility": {"code": self.facility},
                "project": {"href": f"/metal/v1/projects/{self.project_id}"},
                "created_at": _iso(_now()),
            }
            ids.append(rid)
        return ids

    def add_device(self, hostname: str, **overrides: Any) -> JSON:
        """Add an active device directly (as if created long ago), for tests."""
        device = self._new_device(
            {"hostname": hostname, "plan": "c3.small.x86", "tags": []}, reservation=None
        )
        device["state"] = "active"
        self._ready_at.pop(device["id"], None)
        device.update(overrides)
        return device

    def inject(self, method: str, path: str, fault: Fault, *, times: int = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests of ``method`` whose path
        (without query) fully matches the regular expression ``path``."""
        self._injections.append(_Injection(method, re.compile(path), fault, times))

    def managed(self, prefix: str) -> list[JSON]:
        return [d for d in self.devices.values() if d["hostname"].startswith(prefix)]

    # The server.

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on a free 127.0.0.1 port and serve until cancelled.

        ``task_status.started`` gets the base URL (also in :attr:`url`).
        """
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        task_status.started(self.url)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                keep = await self._answer(stream, conn, request, body)
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await stream.aclose()

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and conn.their_state is h11.IDLE:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _answer(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> bool:
        method = request.method.decode()
        target = urllib.parse.urlsplit(request.target.decode())
        path = target.path.removeprefix("/metal/v1")
        query = dict(urllib.parse.parse_qsl(target.query))
        fault = self._fault(method, path)
        if fault is not None and fault.delay and not fault.after:
            await trio.sleep(fault.delay)
        headers: list[tuple[str, str]] = []
        status = 200
        payload: bytes
        if fault is not None and fault.status is not None:
            status = fault.status
            payload = json.dumps({"errors": [fault.message]}).encode()
            if fault.retry_after is not None:
                headers.append(("Retry-After", f"{fault.retry_after:g}"))
        elif fault is not None and fault.drop and not fault.after:
            self.requests.append(Request(method, path, 0))
            return False
        else:
            try:
                token = dict(request.headers).get(b"x-auth-token", b"").decode()
                if token != self.token:
                    raise _HTTPError(401, "Invalid authentication token")
                status, result = self._route(method, path, query, body)
                payload = b"" if result is None else json.dumps(result).encode()
            except _HTTPError as exc:
                status, payload = exc.status, json.dumps({"errors": exc.messages}).encode()
            except Exception as exc:
                # A bug here must look like the real API's bad day, not kill the server.
                logger.exception("local Equinix API: %s %s crashed", method, path)
                status, payload = 500, json.dumps({"errors": [repr(exc)]}).encode()
            if fault is not None and fault.after and fault.delay:
                await trio.sleep(fault.delay)
            if fault is not None and fault.drop:
                self.requests.append(Request(method, path, 0))
                return False
            if fault is not None and fault.malformed is not None and status < 300:
                payload = fault.malformed
        self.requests.append(Request(method, path, status))
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        reason = http.HTTPStatus(status).phrase.encode()
        response = h11.Response(status_code=status, headers=headers, reason=reason)
        await stream.send_all(conn.send(response))
        await stream.send_all(conn.send(h11.Data(data=payload)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return True

    def _fault(self, method: str, path: str) -> Fault | None:
        for injection in self._injections:
            if injection.method == method and injection.path.fullmatch(path):
                injection.remaining -= 1
                if injection.remaining <= 0:
                    self._injections.remove(injection)
                return injection.fault
        return None

    # Routing.

    def _route(self, method: str, path: str, query: dict[str, str], body: bytes) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        match method, parts:
            case "GET", ["projects", project, "devices"]:
                self._project(project)
                self._settle_all()
                return 200, self._page("devices", list(self.devices.values()), path, query)
            case "POST", ["projects", project, "devices"]:
                self._project(project)
                return 201, self._create_device(self._json(body))
            case "GET", ["devices", device_id]:
                return 200, self._settle(self._device(device_id))
            case "DELETE", ["devices", device_id]:
                self._device(device_id)
                self.delete_device(device_id)
                return 204, None
            case "POST", ["devices", device_id, "actions"]:
                self._action(self._device(device_id), self._json(body))
                return 202, None
            case "GET", ["projects", project, "hardware-reservations"]:
                self._project(project)
                items = [self._reservation_view(r) for r in self.reservations.values()]
                return 200, self._page("hardware_reservations", items, path, query)
            case "GET", ["hardware-reservations", rid]:
                if rid not in self.reservations:
                    raise _HTTPError(404, "Not found")
                return 200, self._reservation_view(self.reservations[rid])
            case "GET", ["projects", project, "ssh-keys"]:
                self._project(project)
                return 200, {"ssh_keys": list(self.ssh_keys.values())}
            case "POST", ["projects", project, "ssh-keys"]:
                self._project(project)
                return 201, self._create_key(self._json(body))
            case "GET", ["ssh-keys", key_id]:
                return 200, self._key(key_id)
            case "PATCH", ["ssh-keys", key_id]:
                key = self._key(key_id)
                update = self._json(body)
                for name in ("key", "label"):
                    if name in update:
                        key[name] = update[name]
                key["updated_at"] = _iso(_now())
                return 200, key
        raise _HTTPError(404, "Not found")

    def _project(self, project: str) -> None:
        if project != self.project_id:
            # What the real API answers for a project you cannot see.
            raise _HTTPError(404, "Not found")

    @staticmethod
    def _json(body: bytes) -> JSON:
        try:
            value = json.loads(body or b"{}")
        except ValueError:
            raise _HTTPError(422, "Request body is not valid JSON") from None
        if not isinstance(value, dict):
            raise _HTTPError(422, "Request body must be a JSON object")
        return value

    def _page(self, key: str, items: list[JSON], path: str, query: dict[str, str]) -> JSON:
        try:
            page = max(1, int(query.get("page", "1")))
            per_page = min(self.max_per_page, max(1, int(query.get("per_page", "10"))))
        except ValueError:
            raise _HTTPError(422, "page and per_page must be integers") from None
        total = len(items)
        last = max(1, -(-total // per_page))

        def href(n: int) -> JSON:
            return {"href": f"/metal/v1{path}?page={n}&per_page={per_page}"}

        return {
            key: items[(page - 1) * per_page : page * per_page],
            "meta": {
                "first": href(1),
                "previous": href(page - 1) if page > 1 else None,
                "self": href(page),
                "next": href(page + 1) if page < last else None,
                "last": href(last),
                "current_page": page,
                "last_page": last,
                "total": total,
            },
        }

    def _device(self, device_id: str) -> JSON:
        if device_id not in self.devices:
            raise _HTTPError(404, "Not found")
        return self.devices[device_id]

    def _settle(self, device: JSON) -> JSON:
        ready = self._ready_at.get(device["id"])
        if ready is not None and trio.current_time() >= ready:
            device["state"] = "active"
            del self._ready_at[device["id"]]
        return device

    def _settle_all(self) -> None:
        for device_id in list(self._ready_at):
            self._settle(self.devices[device_id])

    def delete_device(self, device_id: str) -> None:
        """Delete a device (as ``DELETE /devices/{id}``), freeing its reservation."""
        del self.devices[device_id]
        self._ready_at.pop(device_id, None)
        for reservation in self.reservations.values():
            if (reservation["device"] or {}).get("id") == device_id:
                reservation["device"] = None
                reservation["provisionable"] = True

    def _create_device(self, request: JSON) -> JSON:
        errors = [
            f"{name} is required"
            for name in ("hostname", "plan", "operating_system")
            if not request.get(name)
        ]
        if errors:
            raise _HTTPError(422, *errors)
        rid = request.get("hardware_reservation_id")
        reservation = None
        if rid:
            reservation = self.reservations.get(rid)
            if reservation is None:
                raise _HTTPError(422, f"Hardware reservation {rid} not found")
            if reservation["device"] is not None or not reservation["provisionable"]:
                raise _HTTPError(422, f"Hardware reservation {rid} is not provisionable")
        for key_id in request.get("project_ssh_keys") or []:
            if key_id not in self.ssh_keys:
                raise _HTTPError(422, f"SSH key {key_id} not found")
        return self._new_device(request, reservation)

    def _new_device(self, request: JSON, reservation: JSON | None) -> JSON:
        n = next(self._created)
        device_id = str(uuid.uuid4())
        addresses = []
        ipv4 = self.ipv4_for(n)
        if ipv4 is not None:
            addresses.append(self._address(ipv4, 4, public=True))
        addresses.append(self._address(f"2001:db8:{n // 65536:x}:{n % 65536:x}::1", 6, True))
        addresses.append(self._address(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", 4, False))
        device: JSON = {
            "id": device_id,
            "href": f"/metal/v1/devices/{device_id}",
            "hostname": request["hostname"],
            "state": "provisioning",
            "tags": list(request.get("tags") or []),
            "plan": {"slug": request.get("plan")},
            "operating_system": {"slug": request.get("operating_system")},
            "facility": {"code": self.facility},
            "metro": {"code": self.facility[:2]},
            "ip_addresses": addresses,
            "ssh_keys": [
                {"href": f"/metal/v1/ssh-keys/{k}"} for k in request.get("project_ssh_keys") or []
            ],
            "created_at": _iso(_now()),
            "hardware_reservation": None,
        }
        if reservation is not None:
            device["hardware_reservation"] = {"href": reservation["href"]}
            reservation["device"] = {"href": device["href"], "id": device_id}
            reservation["provisionable"] = False
        self.devices[device_id] = device
        self._ready_at[device_id] = trio.current_time() + self.provisioning_delay
        return device

    @staticmethod
    def _address(address: str, family: int, public: bool) -> JSON:
        return {
            "address": address,
            "address_family": family,
            "public": public,
            "management": True,
            "cidr": 31 if family == 4 else 127,
        }

    def _reservation_view(self, reservation: JSON) -> JSON:
        view = dict(reservation)
        if reservation["device"] is not None:
            # The real API embeds the device (tags included) in a reservation.
            device = self.devices.get(reservation["device"]["id"])
            if device is not None:
                view["device"] = self._settle(device)
        return view

    def _action(self, device: JSON, action: JSON) -> None:
        kind = action.get("type")
        if kind not in ("power_on", "power_off", "reboot", "reinstall", "rescue"):
            raise _HTTPError(422, f"Unknown action type {kind!r}")
        if device["state"] != "active" and kind == "reboot":
            raise _HTTPError(422, f"Device is {device['state']}, cannot reboot")
        device.setdefault("actions_log", []).append(kind)
        if kind == "power_off":
            device["state"] = "inactive"
        elif kind == "power_on":
            device["state"] = "active"

    def _key(self, key_id: str) -> JSON:
        if key_id not in self.ssh_keys:
            raise _HTTPError(404, "Not found")
        return self.ssh_keys[key_id]

    def _create_key(self, request: JSON) -> JSON:
        if not request.get("label") or not request.get("key"):
            raise _HTTPError(422, "label and key are required")
        key_id = str(uuid.uuid4())
        key = {
            "id": key_id,
            "href": f"/metal/v1/ssh-keys/{key_id}",
            "label": request["label"],
            "key": request["key"],
            "created_at": _iso(_now()),
            "updated_at": _iso(_now()),
        }
        self.ssh_keys[key_id] = key
        return key

    def statuses(self) -> Iterator[int]:
        return (r.status for r in self.requests)


async def _main(args: argparse.Namespace) -> None:
    api = LocalEquinix(provisioning_delay=args.provisioning_delay)
    api.add_reservations(args.reservations)
    for n in range(args.devices):
        api.add_device(f"{args.device_prefix}{n}")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(api.serve)
        sys.stdout.write(f"url={url} project={api.project_id} token={api.token}\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reservations", type=int, default=10)
    parser.add_argument("--provisioning-delay", type=float, default=5.0)
    parser.add_argument("--devices", type=int, default=0, help="active devices to start with")
    parser.add_argument("--device-prefix", default="shepherd-local-")
    trio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()
