-- Rolling upgrades (issue 40): a run moves a set of installed machines to a
-- new node image, one machine at a time or a few, in the order the Shepherd's
-- upgrader keeps (non-consensus nodes, then consensus members one at a time,
-- the leader's node last), under the process ShepherdUpgrade. `python -m
-- shepherd upgrade` creates the run (audited) and asks every machine of it
-- to write the new image to its inactive slot at once (an UpgradeRequest
-- without activate: no node goes down); the upgrader claims machines as work
-- and activates them in order (the same generation, with activate): the
-- agent callback server carries a machine's request in its heartbeat answers
-- while its row is 'requested', or 'pending' with a request in a running
-- run, and records each agent's UpgradeReport on it.
ALTER TYPE process ADD VALUE 'ShepherdUpgrade';

CREATE TABLE upgrade_run (
    run_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    image_digest text NOT NULL CHECK (image_digest ~ '^sha256:[0-9a-f]{64}$'),
    -- The serialized OSImageRef the agents download (scheme, host, digest).
    os_image_raw bytea NOT NULL,
    max_unavailable integer NOT NULL CHECK (max_unavailable BETWEEN 1 AND 1000),
    health_timeout_seconds integer NOT NULL CHECK (health_timeout_seconds BETWEEN 5 AND 86400),
    requested_by text NOT NULL CHECK (requested_by <> ''),
    requested_at timestamptz NOT NULL DEFAULT now(),
    -- Set when every machine of the run is upgraded, or when the first one
    -- is not (rolled back, failed), with the cause: a run stops there.
    finished_at timestamptz,
    stop_cause text,
    CHECK (stop_cause IS NULL OR finished_at IS NOT NULL)
);
-- One run at a time: two runs on one cluster would each count only their
-- own machines as down.
CREATE UNIQUE INDEX upgrade_run_one_running ON upgrade_run ((true)) WHERE finished_at IS NULL;

CREATE TABLE machine_upgrade (
    run_id uuid NOT NULL REFERENCES upgrade_run (run_id) ON DELETE CASCADE,
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    -- pending: waits for its turn; requested: its request is carried to the
    -- agent, the machine is being upgraded (counts as unavailable);
    -- upgraded, rolled-back, failed: done.
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'requested', 'upgraded', 'rolled-back', 'failed')),
    -- The order: 0 not a consensus member, 1 a consensus member, 2 the
    -- leader's node (as the cluster said when the upgrader last looked),
    -- then position.
    phase smallint NOT NULL DEFAULT 0 CHECK (phase BETWEEN 0 AND 2),
    position integer NOT NULL DEFAULT 0,
    -- The disk the install used, and the image the node ran before.
    root_device text NOT NULL CHECK (root_device <> ''),
    from_digest text,
    -- The machine's upgrade generation (one more than its last, over all
    -- runs) and its UpgradeRequest: set when its write is asked (pending),
    -- the request replaced by one that activates when it is requested.
    generation bigint,
    request_raw bytea,
    requested_at timestamptz,
    -- What the cluster said the node runs when its upgrade ended.
    slot text,
    running_digest text,
    -- One line: why it waits, or why it failed or went back.
    detail text,
    -- The agent's latest UpgradeReport on `generation`.
    agent_state text,
    agent_detail text,
    agent_slot text,
    agent_reported_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, machine_id),
    CHECK (state = 'pending' OR generation IS NOT NULL),
    CHECK ((generation IS NULL) = (request_raw IS NULL))
);
-- A machine has at most one requested row.
CREATE UNIQUE INDEX machine_upgrade_requested ON machine_upgrade (machine_id)
    WHERE state = 'requested';
-- The heartbeat statement's probe: the rows whose request may be carried.
CREATE INDEX machine_upgrade_carried ON machine_upgrade (machine_id)
    WHERE request_raw IS NOT NULL AND state IN ('pending', 'requested');
CREATE INDEX machine_upgrade_machine ON machine_upgrade (machine_id, generation);
