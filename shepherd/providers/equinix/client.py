"""An Equinix Metal API client (httpx, Trio) that tells transient from permanent errors.

What counts as transient is the seed's (``wrapngo``): a connection error, a
429 or a 5xx is retried with exponential backoff, waiting at least as long as
the server's ``Retry-After`` says; 401, 403, 404 and 422 are permanent and
raised at once as :class:`EquinixAPIError` carrying the API's own message.
Any other 4xx is permanent too (a client bug retried is still a bug). A 2xx
whose body is not the JSON object we expect is retried like a 5xx (a proxy
that cut the body short) and then raised as :class:`EquinixMalformedResponse`.

At most ``parallelism`` requests are in flight at once (a retry waits with
its slot released). Device creation is idempotent across retries: the
request carries a witness tag, and before each attempt the client looks at
the hardware reservation; if it already holds a device with that tag, that
device is the answer (the previous attempt's answer was lost), and if it
holds another device, :class:`EquinixRaceLost` (someone else took it).

Cancellation aborts the request in flight or the wait before a retry. A
request the server already acted on is not undone.
"""

from __future__ import annotations

import email.utils
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from common.backoff import ExponentialBackoff
from shepherd.providers.base import ProviderError, describe

logger = logging.getLogger("shepherd.providers.equinix.client")

DEFAULT_API_URL = "https://api.equinix.com/metal/v1"

#: Statuses the seed treats as permanent: retrying cannot help.
PERMANENT_STATUSES = frozenset({401, 403, 404, 422})

JSON = dict[str, Any]


class EquinixError(ProviderError):
    """The Equinix API failed. Subclasses say how."""


class EquinixAPIError(EquinixError):
    """The API refused the request (a permanent error): ``status`` and the API's messages."""

    def __init__(self, method: str, path: str, status: int, messages: list[str]) -> None:
        self.status = status
        self.messages = messages
        super().__init__(f"{method} {path}: {status}: {'; '.join(messages) or '(no message)'}")


class EquinixUnavailable(EquinixError):
    """Transient failures went on past the retry budget; the last one is the cause."""


class EquinixMalformedResponse(EquinixError):
    """The API kept answering 2xx with a body that is not what the API documents."""


class EquinixRaceLost(EquinixError):
    """A hardware reservation we tried to deploy holds someone else's device."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``initial`` x ``multiplier`` per attempt, capped at
    ``maximum``; give up after ``attempts`` attempts. A ``Retry-After`` from the
    server is waited for in full (up to ``max_retry_after``) if it is longer."""

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0
    attempts: int = 8
    max_retry_after: float = 300.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """The wait after failed ``attempt`` (1-based), given the server's ``Retry-After``."""
        backoff = ExponentialBackoff(self.initial, self.maximum, self.multiplier).delay(attempt)
        if retry_after is not None:
            return max(backoff, min(retry_after, self.max_retry_after))
        return backoff


class _Transient(EquinixError):
    """A failure worth retrying; never escapes the client (see ``_retrying``)."""

    def __init__(
        self, cause: str, retry_after: float | None = None, *, malformed: bool = False
    ) -> None:
        super().__init__(cause)
        self.retry_after = retry_after
        self.malformed = malformed


class EquinixClient:
    """The API calls the Shepherd makes. Use as an async context manager.

    ``token`` is sent as ``X-Auth-Token``. ``sleep`` is how retries wait
    (tests record the waits through it). ``per_page`` is the page size asked
    for when listing; the server may hand out fewer.
    """

    def __init__(
        self,
        token: str,
        *,
        base_url: str = DEFAULT_API_URL,
        parallelism: int = 4,
        retry: RetryPolicy | None = None,
        timeout: float = 30.0,
        per_page: int = 500,
        sleep: Callable[[float], Awaitable[None]] = trio.sleep,
    ) -> None:
        if parallelism < 1:
            raise ValueError(f"parallelism must be at least 1, got {parallelism}")
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"X-Auth-Token": token, "Accept": "application/json"},
            timeout=timeout,
        )
        self._slots = trio.Semaphore(parallelism)
        self._retry = retry or RetryPolicy()
        self._per_page = per_page
        self._sleep = sleep

    async def __aenter__(self) -> EquinixClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # The transport.

    async def _call(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        """One API call, retried while the failure is transient."""
        return await self._retrying(
            f"{method} {path}", lambda: self._once(method, path, params, body)
        )

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[Any]]) -> Any:
        for n in range(1, self._retry.attempts + 1):
            try:
                return await attempt()
            except _Transient as exc:
                if n == self._retry.attempts:
                    if exc.malformed:
                        raise EquinixMalformedResponse(f"{what}: {exc}") from None
                    raise EquinixUnavailable(f"{what}: gave up after {n} attempts: {exc}") from None
                delay = self._retry.delay(n, exc.retry_after)
                logger.warning("%s: %s; retry %d in %.2fs", what, exc, n, delay)
                await self._sleep(delay)
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, params: dict[str, Any] | None, body: Any) -> Any:
        async with self._slots:
            try:
                response = await self._http.request(method, path, params=params, json=body)
            except httpx.RequestError as exc:  # connection, timeout, protocol, decoding
                raise _Transient(f"{type(exc).__name__}: {describe(exc)}") from None
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Transient(
                f"{status} {response.reason_phrase}: {'; '.join(_messages(response))}",
                _retry_after(response),
            )
        if status >= 400:
            raise EquinixAPIError(method, path, status, _messages(response))
        if status == 204 or (status == 202 and not response.content):
            return None
        try:
            value = response.json()
        except ValueError:
            raise _Transient(
                f"{status} response is not JSON: {response.text[:80]!r}", malformed=True
            ) from None
        if not isinstance(value, dict):
            raise _Transient(f"{status} response is not a JSON object", malformed=True)
        return value

    async def _list(self, path: str, key: str) -> list[JSON]:
        items: list[JSON] = []
        page = 1
        while True:
            body = await self._call("GET", path, params={"page": page, "per_page": self._per_page})
            chunk = body.get(key)
            if not isinstance(chunk, list) or not all(isinstance(i, dict) for i in chunk):
                raise EquinixMalformedResponse(f"GET {path}: {key!r} is not a list of objects")
            items += chunk
            meta = body.get("meta") or {}
            if not isinstance(meta, dict) or not meta.get("next"):
                return items
            page += 1

    # The API.

    async def list_devices(self, project_id: str) -> list[JSON]:
        """Every device of the project (all pages)."""
        return await self._list(f"/projects/{project_id}/devices", "devices")

    async def get_device(self, device_id: str) -> JSON:
        device: JSON = await self._call("GET", f"/devices/{device_id}")
        return device

    async def delete_device(self, device_id: str) -> None:
        await self._call("DELETE", f"/devices/{device_id}")

    async def reboot_device(self, device_id: str) -> None:
        await self._call("POST", f"/devices/{device_id}/actions", body={"type": "reboot"})

    async def list_reservations(self, project_id: str) -> list[JSON]:
        return await self._list(
            f"/projects/{project_id}/hardware-reservations", "hardware_reservations"
        )

    async def get_reservation(self, reservation_id: str) -> JSON:
        reservation: JSON = await self._call("GET", f"/hardware-reservations/{reservation_id}")
        return reservation

    async def create_device(self, project_id: str, request: JSON) -> JSON:
        """Deploy a device on ``request["hardware_reservation_id"]``, at most once.

        Raises :class:`EquinixRaceLost` if the reservation holds a device that
        is not ours, :class:`ValueError` if the request names no reservation.
        """
        reservation_id = request.get("hardware_reservation_id")
        if not reservation_id:
            raise ValueError("hardware_reservation_id must be set")
        witness = f"shepherd-idempotency-{uuid.uuid4()}"
        request = {**request, "tags": [*request.get("tags", []), witness]}
        path = f"/projects/{project_id}/devices"

        async def attempt() -> JSON:
            reservation = await self._once(
                "GET", f"/hardware-reservations/{reservation_id}", None, None
            )
            device = reservation.get("device")
            if isinstance(device, dict) and device:
                if witness not in (device.get("tags") or []):
                    raise EquinixRaceLost(
                        f"hardware reservation {reservation_id} holds device "
                        f"{device.get('id')}, which is not ours"
                    )
                logger.info("reservation %s: found our device %s", reservation_id, device.get("id"))
                if "hostname" not in device:
                    # A reservation that only links its device: read it.
                    full: JSON = await self._once("GET", f"/devices/{device['id']}", None, None)
                    return full
                return device
            created: JSON = await self._once("POST", path, None, request)
            return created

        result: JSON = await self._retrying(f"POST {path}", attempt)
        return result

    async def list_ssh_keys(self, project_id: str) -> list[JSON]:
        return await self._list(f"/projects/{project_id}/ssh-keys", "ssh_keys")

    async def create_ssh_key(self, project_id: str, label: str, key: str) -> JSON:
        created: JSON = await self._call(
            "POST", f"/projects/{project_id}/ssh-keys", body={"label": label, "key": key}
        )
        return created

    async def update_ssh_key(self, key_id: str, key: str) -> JSON:
        updated: JSON = await self._call("PATCH", f"/ssh-keys/{key_id}", body={"key": key})
        return updated


def _messages(response: httpx.Response) -> list[str]:
    """The API's error messages: ``{"errors": [...]}`` or ``{"error": "..."}``."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return [text[:200]] if text else []
    if isinstance(body, dict):
        if isinstance(body.get("errors"), list):
            return [str(m) for m in body["errors"]]
        if "error" in body:
            return [str(body["error"])]
    return [response.text[:200]]


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), None if absent or bad."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        at = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, at.timestamp() - time.time())
