-- An operator's action waiting for a machine's work to end (issue 35): while
-- a row here is unexpired, no process claims the machine anew (every sourcing
-- query and the work claim skip it, as they skip a hold), so the action lands
-- as soon as the work in progress ends instead of racing busy workers for a
-- free moment it may never find.
--
-- bmdb/actions.py inserts the row, in a transaction of its own, when a
-- `--wait` action first finds the machine busy, and deletes it in the
-- transaction that lands the action, or when its waiter gives up. A waiter
-- that dies (a killed CLI) cannot delete it: the row is tied to an expiry,
-- the end of the waiter's own wait, after which every query ignores it, so
-- a dead waiter blocks the machine no longer than it would have waited.
-- Expired rows are deleted by the next waiter on the same machine.
CREATE TABLE machine_pending_action (
    pending_id uuid PRIMARY KEY,
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    action text NOT NULL CHECK (action ~ '^[a-z][a-z-]*$'),
    requested_by text NOT NULL CHECK (requested_by <> ''),
    until timestamptz NOT NULL
);
CREATE INDEX machine_pending_action_machine ON machine_pending_action (machine_id, until);
