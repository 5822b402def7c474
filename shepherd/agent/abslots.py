"""A/B system slots: a new node image tried once, kept only when the node comes up healthy.

Standard library only, and importable two ways: as ``shepherd.agent.abslots``
(the agent) and as plain ``abslots`` beside ``bootprep.py`` on an installed
machine, where the installer copies it (`bootentry.write_boot_entry`) and the
boot runs it. It holds the slot state machine and where its state is kept;
the agent's upgrade (`shepherd.agent.upgrade`) writes a new slot, the boot
(``bootprep.py``) picks a slot, and the boot check (``bootprep.py --check``,
unit `CHECK_UNIT`) keeps a tried slot or goes back. The same machine runs on
a loopback disk (a folder), driven by the agent instead of a boot.

The state
---------
::

    slots      a: {sha256, bytes} | null     what each system slot holds
               b: {sha256, bytes} | null     (written and read back first)
    active     a | b                         booted by default
    next       a | b | null                  a one-shot try: booted instead of
    tries      0..                           `active` while tries > 0
    trying     a | b | null                  the try a boot consumed (set just
                                             before that boot)
    health_timeout   seconds                 how long a try has to be confirmed
    rolled_back      {slot, sha256, cause} | null    the last try that failed

Its transitions, and which write makes each (every write replaces the whole
state at once, see "Where it is kept")::

    INSTALLED ─── upgrade (agent) ──────────────────────────────────────────┐
    active=a       1. image written to the inactive slot b (raw), its       │
    next=null         SHA-256 read back from the device                     │
                   2. helpers and the check unit refreshed                  │
                   3. WRITE: slots.b, next=b, tries=1, rolled_back=null     │
                   4. reboot                                                │
                                                                            ▼
    STAGED         boot (bootprep): next=b and tries>0                  STAGED
    next=b           WRITE: tries=0, trying=b          (before anything of b runs)
    tries=1          extract b, check its SHA-256 ── mismatch ──┐
                     boot.json {slot b, trial}                  │ WRITE: rolled back
                     node runs from b                           │ boot a at once
                                                                ▼
    TRYING         check (unit, from this boot):            ROLLED BACK
    next=b           healthy.json in time (the node:        active=a, next=null
    tries=0          the cluster took its status, its      rolled_back={b, cause}
    trying=b         roles run) ── WRITE: active=b,                ▲
                     next=null; boot.json trial=false              │
                     ──▶ COMMITTED (b permanent)                   │
                   no healthy.json within health_timeout, ─────────┤ WRITE: rolled back
                     or the node exited: then reboot               │ (with that cause)
                   power cut, crash, any reboot before             │
                     the confirm: boot (bootprep) finds ───────────┘ WRITE: rolled back
                     next=b, tries=0

What a crash at each point leaves, and what the next boot does (the
invariant: every boot runs a slot whose image was read back whole and
whose SHA-256 matches, and a slot that was never confirmed healthy is
booted at most ``tries`` times before the machine goes back to the last
confirmed slot):

    during 1 or 2 (image, helpers)   the state is untouched (next=null): the
                                     old slot boots; slot b holds garbage that
                                     nothing points at, the next upgrade
                                     writes it again
    during write 3                   a torn copy fails its checksum: the
                                     other copy (INSTALLED) is read, as if 3
                                     never happened
    between 3 and 4 (no reboot yet)  STAGED: the next boot, whenever it
                                     comes, tries b once
    during the consume write         torn: STAGED is read again, b is tried
                                     then (b never ran)
    after it, during the extraction  TRYING with nothing confirmed: the next
                                     boot goes back to a (a counted try is a
                                     try, as systemd's boot counting has it)
    during the confirm write         torn: TRYING is read, the next boot
                                     goes back to a, though b was healthy;
                                     the Shepherd sees the rollback and says
                                     so (conservative, never a bad slot)
    during the check's give-up write torn: TRYING, the next boot goes back
                                     (with its own, vaguer, cause)
    during the rollback write        torn: TRYING again, the next boot writes
                                     the rollback again

The data partition is never written by any of this.

Where it is kept
----------------
On a real disk (`DeviceStore`): the last 8 KiB of the boot partition, as
two 4 KiB copies, each ``MAGIC | seq (u64) | length (u32) | JSON | SHA-256``
of all before it. A write takes the newest valid copy's seq + 1 and goes to
the copy of that parity, the one *not* holding the newest state, then
fsyncs: whatever a power cut leaves of it, the other copy still holds the
state before, and a reader takes the valid copy with the higher seq (a
torn copy fails its checksum). The boot record at the start of the
partition (`bootrecord.write_boot_record`: the install's slot A image and
NodeParameters) is never rewritten; a disk with no valid copy is in
INSTALLED state with slot a from that record. On a loopback disk
(`FolderStore`): ``slots.json`` in the disk's folder, replaced atomically
(temp file, fsync, rename, fsync of the folder).

The boot tells the node what it booted in ``boot.json`` (`boot_info`:
slot, image, whether a try, the last rollback), which the node reports in
its status (``metropolis.roleserve.bootinfo``); the node writes
``healthy.json`` once the cluster took its status and its roles run
(``metropolis.roleserve.bootcheck``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Callable

CRASH_ENV = "METROPOLIS_TEST_CRASH_AT"
#: Test hook: SIGSTOP this process at the step named (a test then cuts the
#: machine's power there, through its BMC).
STOP_ENV = "METROPOLIS_TEST_STOP_AT"
SLOTS = ("a", "b")
#: The boot check's unit (written by the installer and the upgrade).
CHECK_UNIT = "metropolis-boot-check.service"
#: What the boot writes and the node reads; what the node writes once healthy.
BOOT_INFO, HEALTHY = "boot.json", "healthy.json"

MAGIC = b"MONOTRIO-SLOTS1\n"
COPY = 4096
_HEAD = struct.Struct(">QI")  # seq, payload length
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Longest rollback cause kept, characters.
MAX_CAUSE = 500
#: Seconds a try has to be confirmed when the request names none.
DEFAULT_HEALTH_TIMEOUT = 300.0


class SlotError(Exception):
    """The slot state cannot be read or changed as asked, or a slot's image does
    not match; the message says why. (Not an `AgentError`: this module imports
    nothing of the agent's, so that it runs alone beside ``bootprep.py``; the
    agent's upgrade reports it as its cause.)"""


def crash_point(step: str) -> None:
    """SIGKILL this process here if ``METROPOLIS_TEST_CRASH_AT`` names ``step``;
    SIGSTOP it if ``METROPOLIS_TEST_STOP_AT`` does."""
    import signal

    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(STOP_ENV) == step:
        os.kill(os.getpid(), signal.SIGSTOP)


def other(slot: str) -> str:
    return "b" if slot == "a" else "a"


@dataclasses.dataclass(frozen=True)
class SlotImage:
    """What a slot holds: the image's hex SHA-256 and its size in bytes."""

    sha256: str
    size: int


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """The last try that failed: its slot, image and why."""

    slot: str
    sha256: str
    cause: str


@dataclasses.dataclass(frozen=True)
class SlotState:
    """See the module docstring. ``seq`` is where a `DeviceStore` read it."""

    slots: dict[str, SlotImage | None]
    active: str
    next: str | None = None
    tries: int = 0
    trying: str | None = None
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    rolled_back: RolledBack | None = None
    seq: int = 0

    def image(self, slot: str) -> SlotImage:
        held = self.slots.get(slot)
        if held is None:
            raise SlotError(f"slot {slot} holds no image")
        return held


def initial(image_a: SlotImage) -> SlotState:
    """An installed disk's state: slot a holds the install's image."""
    return SlotState(slots={"a": image_a, "b": None}, active="a")


# --- the transitions (pure)


def stage(state: SlotState, image: SlotImage, health_timeout: float, tries: int = 1) -> SlotState:
    """The state after the inactive slot was written with ``image``: tried next.
    SlotError while another try is staged or under way."""
    if state.next is not None:
        raise SlotError(
            f"a try of slot {state.next} is staged or under way: reboot (or wait for its "
            "check) before staging another"
        )
    if not health_timeout > 0 or tries < 1:
        raise SlotError("a try needs a positive health timeout and at least one boot")
    target = other(state.active)
    return dataclasses.replace(
        state,
        slots={**state.slots, target: image},
        next=target,
        tries=tries,
        trying=None,
        health_timeout=float(health_timeout),
        rolled_back=None,
    )


@dataclasses.dataclass(frozen=True)
class Boot:
    """What one boot runs: the slot, its image, and whether it is a try."""

    slot: str
    image: SlotImage
    trial: bool


def rolled_back(state: SlotState, cause: str) -> SlotState:
    """The state that goes back from the try of ``state.next`` to the active slot."""
    assert state.next is not None
    held = state.slots.get(state.next)
    return dataclasses.replace(
        state,
        next=None,
        tries=0,
        trying=None,
        rolled_back=RolledBack(state.next, held.sha256 if held else "", cause[:MAX_CAUSE]),
    )


def choose(state: SlotState) -> tuple[Boot, SlotState | None]:
    """Which slot this boot runs, and the state to write *before* it runs (None: none)."""
    if state.next is not None and state.tries > 0:
        after = dataclasses.replace(state, tries=state.tries - 1, trying=state.next)
        return Boot(state.next, state.image(state.next), True), after
    if state.next is not None:
        cause = (
            f"slot {state.next} was booted for a try and not confirmed healthy (no healthy "
            f"node within {state.health_timeout:g} s of its boot, or its boot was cut)"
        )
        after = rolled_back(state, cause)
        return Boot(after.active, after.image(after.active), False), after
    return Boot(state.active, state.image(state.active), False), None


def confirm(state: SlotState, slot: str, sha256: str) -> SlotState | None:
    """The state that makes the tried ``slot`` permanent; None if it is not under try
    (or holds another image)."""
    held = state.slots.get(slot)
    if state.trying != slot or state.next != slot or held is None or held.sha256 != sha256:
        return None
    return dataclasses.replace(state, active=slot, next=None, tries=0, trying=None)


# --- encoding


def encode(state: SlotState) -> bytes:
    slots = {
        s: None if img is None else {"sha256": img.sha256, "bytes": img.size}
        for s, img in sorted(state.slots.items())
    }
    back = state.rolled_back
    return json.dumps(
        {
            "slots": slots,
            "active": state.active,
            "next": state.next,
            "tries": state.tries,
            "trying": state.trying,
            "health_timeout": state.health_timeout,
            "rolled_back": None
            if back is None
            else {"slot": back.slot, "sha256": back.sha256, "cause": back.cause},
        },
        sort_keys=True,
    ).encode()


def _slot(value: object, what: str, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if value not in SLOTS:
        raise SlotError(f"slot state: {what} {value!r} is not a slot")
    return str(value)


def decode(data: bytes, seq: int = 0) -> SlotState:
    """The state ``encode`` wrote; SlotError for anything else."""
    try:
        fields = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SlotError(f"slot state is not JSON: {exc}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("slots"), dict):
        raise SlotError("slot state: not an object with slots")
    slots: dict[str, SlotImage | None] = {}
    for name in SLOTS:
        held = fields["slots"].get(name)
        if held is None:
            slots[name] = None
            continue
        if (
            not isinstance(held, dict)
            or not isinstance(held.get("sha256"), str)
            or not _HEX64.fullmatch(held["sha256"])
            or not isinstance(held.get("bytes"), int)
            or held["bytes"] <= 0
        ):
            raise SlotError(f"slot state: slot {name} is not {{sha256, bytes}}")
        slots[name] = SlotImage(held["sha256"], held["bytes"])
    active = _slot(fields.get("active"), "active", optional=False)
    assert active is not None
    nxt = _slot(fields.get("next"), "next", optional=True)
    trying = _slot(fields.get("trying"), "trying", optional=True)
    tries = fields.get("tries")
    timeout = fields.get("health_timeout")
    if not isinstance(tries, int) or isinstance(tries, bool) or tries < 0:
        raise SlotError("slot state: tries is not a count")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise SlotError("slot state: health_timeout is not positive")
    back = fields.get("rolled_back")
    rolled: RolledBack | None = None
    if back is not None:
        if not (
            isinstance(back, dict)
            and back.get("slot") in SLOTS
            and isinstance(back.get("sha256"), str)
            and isinstance(back.get("cause"), str)
        ):
            raise SlotError("slot state: rolled_back is not {slot, sha256, cause}")
        rolled = RolledBack(back["slot"], back["sha256"], back["cause"][:MAX_CAUSE])
    if slots[active] is None or (nxt is not None and (slots[nxt] is None or nxt == active)):
        raise SlotError("slot state: active or next names an empty slot")
    return SlotState(slots, active, nxt, tries, trying, float(timeout), rolled, seq)


# --- where it is kept


class DeviceStore:
    """The state in the last two 4 KiB of the boot partition (see the module).

    ``record_end``: where the boot record at the partition's start ends; a
    partition too small to keep both apart is refused.
    """

    def __init__(self, node: str, record_end: int = 0) -> None:
        self.node = node
        with open(node, "rb") as f:
            size = f.seek(0, os.SEEK_END)
        if size < record_end + 2 * COPY:
            raise SlotError(
                f"the boot partition {node} ({size} bytes) has no room for the slot state "
                f"after its boot record ({record_end} bytes)"
            )
        self.offsets = (size - 2 * COPY, size - COPY)

    def _copies(self) -> list[tuple[int, SlotState]]:
        found = []
        with open(self.node, "rb") as f:
            for offset in self.offsets:
                f.seek(offset)
                raw = f.read(COPY)
                if len(raw) < COPY or not raw.startswith(MAGIC):
                    continue
                seq, length = _HEAD.unpack_from(raw, len(MAGIC))
                end = len(MAGIC) + _HEAD.size + length
                if end + 32 > COPY or hashlib.sha256(raw[:end]).digest() != raw[end : end + 32]:
                    continue  # torn or damaged: the other copy holds the state
                try:
                    found.append((seq, decode(raw[len(MAGIC) + _HEAD.size : end], seq)))
                except SlotError:
                    continue
        return found

    def read(self) -> SlotState | None:
        """The newest valid state, or None if neither copy holds one."""
        copies = self._copies()
        return max(copies, key=lambda c: c[0])[1] if copies else None

    def clear(self) -> None:
        """Zero both copies (a new install: the state is the boot record's again)."""
        fd = os.open(self.node, os.O_WRONLY)
        try:
            for offset in self.offsets:
                os.pwrite(fd, b"\0" * COPY, offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, state: SlotState) -> SlotState:
        """Write ``state`` as the newest (into the copy not holding the newest); fsynced."""
        newest = max((seq for seq, _ in self._copies()), default=0)
        seq = newest + 1
        payload = encode(state)
        body = MAGIC + _HEAD.pack(seq, len(payload)) + payload
        if len(body) + 32 > COPY:
            raise SlotError(f"slot state of {len(payload)} bytes does not fit a copy")
        raw = body + hashlib.sha256(body).digest()
        raw += b"\0" * (COPY - len(raw))
        fd = os.open(self.node, os.O_WRONLY)
        try:
            os.pwrite(fd, raw, self.offsets[seq % 2])
            os.fsync(fd)
        finally:
            os.close(fd)
        return dataclasses.replace(state, seq=seq)


class FolderStore:
    """The state of a loopback disk: ``slots.json`` in its folder, replaced atomically."""

    NAME = "slots.json"

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, self.NAME)

    def read(self) -> SlotState | None:
        try:
            with open(self.path, "rb") as f:
                return decode(f.read(64 * 1024))
        except FileNotFoundError:
            return None

    def write(self, state: SlotState) -> SlotState:
        write_file(self.path, encode(state))
        return state


Store = DeviceStore | FolderStore


def write_file(path: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` atomically and durably (temp, fsync, rename, fsync of the folder)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_unit(python: str, helper: str, boot_partuuid: str) -> str:
    """The text of `CHECK_UNIT`: ``helper --check`` once the node unit started."""
    return (
        "[Unit]\nDescription=Metropolis: keep a slot tried once if its node is healthy, "
        "else go back\nAfter=metropolis-node.service\n\n"
        f"[Service]\nType=simple\nExecStart={python} {helper} --check {boot_partuuid}\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


# --- the boot and the check, on any store


def boot_info(boot: Boot, state: SlotState) -> bytes:
    """``boot.json``: what this boot runs, for the node (see the module)."""
    back = state.rolled_back
    return (
        json.dumps(
            {
                "slot": boot.slot,
                "image_sha256": boot.image.sha256,
                "trial": boot.trial,
                "rolled_back_sha256": back.sha256 if back else "",
                "rollback_cause": back.cause if back else "",
            },
            sort_keys=True,
        ).encode()
        + b"\n"
    )


def boot(
    store: Store,
    default: Callable[[], SlotState],
    extract: Callable[[str, SlotImage], None],
    run_dir: str,
) -> Boot:
    """One boot: choose the slot (writing the state first when it changes),
    ``extract`` it (SlotError if its image does not match: a tried slot is
    then given up at once and the active one extracted), write ``boot.json``
    into ``run_dir``. ``default``: the state of a disk that has none yet."""
    state = store.read() or default()
    chosen, after = choose(state)
    if after is not None:
        crash_point("slots-boot-write")
        state = store.write(after)
        crash_point("slots-boot-written")
    try:
        extract(chosen.slot, chosen.image)
    except SlotError as exc:
        if not chosen.trial:
            raise
        state = store.write(rolled_back(state, f"slot {chosen.slot} did not boot: {exc}"))
        chosen = Boot(state.active, state.image(state.active), False)
        extract(chosen.slot, chosen.image)
    write_file(os.path.join(run_dir, BOOT_INFO), boot_info(chosen, state))
    return chosen


def read_json(path: str) -> dict[str, object] | None:
    """A small JSON object file, or None if it is missing or not one."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read(64 * 1024))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def confirmed(run_dir: str, slot: str, sha256: str) -> bool:
    """Whether the node announced itself healthy on ``slot`` running ``sha256``."""
    said = read_json(os.path.join(run_dir, HEALTHY))
    return said is not None and said.get("slot") == slot and said.get("image_sha256") == sha256


def check(
    store: Store,
    run_dir: str,
    reboot: Callable[[], None],
    *,
    poll: float = 1.0,
    log: Callable[[str], None] = lambda _: None,
    alive: Callable[[], bool] | None = None,
) -> str:
    """The boot check: keep a tried slot once the node says it is healthy, or
    ``reboot`` (the next boot goes back) when it does not within the state's
    health timeout, or as soon as ``alive`` (if given) says the node is gone.
    Returns what it did: "no try", "confirmed", "rebooted"."""
    info = read_json(os.path.join(run_dir, BOOT_INFO))
    if info is None or info.get("trial") is not True:
        return "no try"
    slot, sha256 = str(info.get("slot")), str(info.get("image_sha256"))
    state = store.read()
    if state is None or state.trying != slot:
        return "no try"
    deadline = time.monotonic() + state.health_timeout
    log(f"slot {slot} is on trial: waiting up to {state.health_timeout:g} s for a healthy node")
    while time.monotonic() < deadline:
        if confirmed(run_dir, slot, sha256):
            after = confirm(state, slot, sha256)
            if after is None:
                return "no try"
            crash_point("slots-confirm-write")
            state = store.write(after)
            boot_now = Boot(slot, state.image(slot), False)
            write_file(os.path.join(run_dir, BOOT_INFO), boot_info(boot_now, state))
            log(f"slot {slot} confirmed healthy: it is the active slot now")
            return "confirmed"
        if alive is not None and not alive():
            return _give_up(
                store, state, f"the node of slot {slot} exited before it was healthy", reboot, log
            )
        time.sleep(poll)
    return _give_up(
        store,
        state,
        f"slot {slot} was not confirmed healthy within {state.health_timeout:g} s of its boot",
        reboot,
        log,
    )


def _give_up(
    store: Store,
    state: SlotState,
    cause: str,
    reboot: Callable[[], None],
    log: Callable[[str], None],
) -> str:
    """End a try that failed: the state goes back (with the cause, for the
    node and the Shepherd to say), then ``reboot``. A cut before the write
    leaves TRYING, which the next boot takes back all the same."""
    crash_point("slots-give-up-write")
    store.write(rolled_back(state, cause))
    log(f"{cause}: going back to slot {state.active}, rebooting")
    reboot()
    return "rebooted"
