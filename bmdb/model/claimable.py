"""When a process may claim a machine: the SQL conditions every source shares.

A source (`bmdb.model.sourcing`'s, the decommissioner's, the upgrader's)
offers a machine only without live work of the processes that must not run
on it at the same time (`LIVE_WORK`), without an active backoff of its own
process (`ACTIVE_BACKOFF`), and not held by an operator (`NOT_HELD`,
`NOT_PENDING`). They are written once here so that every source means the
same by "free". Each is SQL text on machine ``m``, with the parameters
``%(busy)s`` (a process[]) and ``%(process)s`` where it names them.
"""

from __future__ import annotations

from bmdb.model.enums import Process

#: Processes that must not run on one machine at the same time as agent start.
AGENT_PROCESSES = (Process.SHEPHERD_AGENT_START, Process.SHEPHERD_RECOVERY)

#: A machine has live work in one of the processes %(busy)s. Work rows of
#: sessions past their deadline do not count: their owner is gone.
LIVE_WORK = """
    EXISTS (SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
            WHERE w.machine_id = m.machine_id AND w.process = ANY(%(busy)s::process[])
              AND s.session_deadline > now())
"""

#: An operator's action waits for the machine's work to end (see
#: bmdb/actions.py and migration 0008): no process claims it anew meanwhile.
NOT_PENDING = """
    NOT EXISTS (SELECT 1 FROM machine_pending_action pa
                WHERE pa.machine_id = m.machine_id AND pa.until > now())
"""

#: The machine is not held by an operator (see bmdb/actions.py), nor about
#: to be (`NOT_PENDING`), and not asked to be (or already) decommissioned: no
#: process is offered such a machine (the decommissioner has its own source).
NOT_HELD = f"""
    NOT EXISTS (SELECT 1 FROM machine_hold hd WHERE hd.machine_id = m.machine_id)
    AND {NOT_PENDING}
    AND NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = m.machine_id)
"""

#: The machine is in backoff for the process %(process)s: it failed there
#: lately, and is hidden from that process until the backoff ends.
ACTIVE_BACKOFF = """
    EXISTS (SELECT 1 FROM work_backoff b
            WHERE b.machine_id = m.machine_id AND b.process = %(process)s::process
              AND b.until > now())
"""
