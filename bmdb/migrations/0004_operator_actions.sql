-- Operator actions (issue 27): holds, recovery requests, and the audit log
-- that records every action an operator took, who, when, what and why.
-- bmdb/actions.py writes all three, each action in one transaction with its
-- audit record.

-- A held machine is offered to no process: every sourcing query and the
-- work claim itself skip machines with a row here (bmdb/model/queries.py,
-- bmdb/work.py), until an operator releases it.
CREATE TABLE machine_hold (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    held_by text NOT NULL CHECK (held_by <> ''),
    held_at timestamptz NOT NULL DEFAULT now(),
    reason text NOT NULL CHECK (reason <> '')
);

-- An operator asked for the machine's recovery now: the recovery source
-- takes it whatever its heartbeat says; the recoverer deletes the row when
-- it finishes.
CREATE TABLE machine_recovery_request (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    requested_by text NOT NULL CHECK (requested_by <> ''),
    requested_at timestamptz NOT NULL DEFAULT now()
);

-- Append-only. machine_id has no foreign key on purpose: the record of
-- forgetting a machine outlives the machine.
CREATE TABLE audit_log (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    operator text NOT NULL CHECK (operator <> ''),
    action text NOT NULL CHECK (action ~ '^[a-z][a-z-]*$'),
    machine_id uuid,
    reason text NOT NULL CHECK (reason <> ''),
    -- What changed, in one line (the CLI printed the same).
    detail text NOT NULL
);
CREATE INDEX audit_log_machine ON audit_log (machine_id, id);
