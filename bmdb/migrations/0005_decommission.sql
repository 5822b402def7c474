-- Decommissioning (issue 27): a process of its own, and the tombstone it
-- leaves. An operator asks (python -m bmdb decommission, audited); the
-- Shepherd's decommissioner has the agent wipe the machine, records the
-- wipe report, has the provider release the machine, and sets
-- decommissioned_at. From the request on, no other process is offered the
-- machine (bmdb/model/queries.py), nor any process once it is a tombstone.
ALTER TYPE process ADD VALUE 'ShepherdDecommission';

CREATE TABLE machine_decommission (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    requested_by text NOT NULL CHECK (requested_by <> ''),
    requested_at timestamptz NOT NULL DEFAULT now(),
    reason text NOT NULL CHECK (reason <> ''),
    -- The agent's wipe report (what it stopped and removed), when it came.
    wiped_at timestamptz,
    wipe_report text,
    -- The provider's line on the release (device deleted, marked removed).
    released_at timestamptz,
    release_detail text,
    -- Set last: the machine is a tombstone, kept with its history.
    decommissioned_at timestamptz,
    CHECK ((wiped_at IS NULL) = (wipe_report IS NULL)),
    CHECK ((released_at IS NULL) = (release_detail IS NULL)),
    -- Never released before its wipe is reported, never done before both.
    CHECK (released_at IS NULL OR wiped_at IS NOT NULL),
    CHECK (decommissioned_at IS NULL OR released_at IS NOT NULL)
);
