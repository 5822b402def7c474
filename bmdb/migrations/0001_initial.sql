-- The initial BMDB schema: machines, their tags, and the session/work/backoff
-- machinery that lets many workers act on machines without stepping on each
-- other.

CREATE TYPE provider AS ENUM ('Equinix', 'Static');

CREATE TYPE provider_status AS ENUM (
    'Unknown', 'Running', 'Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing'
);

-- Every kind of work a component can do on a machine. A machine has at most
-- one work row per process at a time.
CREATE TYPE process AS ENUM (
    'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdProvision', 'UnitTest1', 'UnitTest2'
);

CREATE TYPE work_history_event AS ENUM ('Started', 'Finished', 'Failed', 'Canceled');

CREATE TABLE machines (
    machine_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    -- clock_timestamp(), not now(): machines created in one transaction keep
    -- their creation order.
    machine_created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Bumped by every work claim. A claimer that sourced this machine from an
    -- older snapshot then fails to lock it (a serialization failure, retried)
    -- instead of claiming it a second time. See bmdb/work.py.
    work_generation bigint NOT NULL DEFAULT 0,
    -- Mirrors "a machine_agent_started row exists" (kept by a trigger below),
    -- so that the agent-start candidates have their own partial index and the
    -- cost of sourcing one stays flat however many machines were processed.
    agent_started boolean NOT NULL DEFAULT false
);
CREATE INDEX machines_created ON machines (machine_created_at, machine_id);
CREATE INDEX machines_agent_start_pending ON machines (machine_created_at, machine_id)
    WHERE NOT agent_started;

CREATE TABLE sessions (
    session_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    session_component_name text NOT NULL,
    session_runtime_info text NOT NULL,
    session_created_at timestamptz NOT NULL DEFAULT now(),
    session_interval_seconds double precision NOT NULL CHECK (session_interval_seconds > 0),
    -- A session is valid while session_deadline > now(). Not indexed on
    -- purpose: heartbeats then stay HOT updates, and the table is small.
    session_deadline timestamptz NOT NULL
);

-- A work row is a lock on (machine, process) held by a session. Rows of
-- sessions past their deadline are ignored by sourcing and replaced by the
-- next claim; deleting the session (close or GC) deletes them.
CREATE TABLE work (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    session_id uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    process process NOT NULL,
    PRIMARY KEY (machine_id, process)
);
CREATE INDEX work_session ON work (session_id);

CREATE TABLE work_history (
    id bigserial PRIMARY KEY,
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process process NOT NULL,
    event work_history_event NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    session_id uuid,
    cause text
);
CREATE INDEX work_history_machine ON work_history (machine_id, id);

CREATE TABLE work_backoff (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process process NOT NULL,
    until timestamptz NOT NULL,
    cause text NOT NULL,
    -- The interval that produced `until`, the base of the next exponential step.
    last_interval_seconds bigint NOT NULL,
    PRIMARY KEY (machine_id, process)
);

-- Tags: one table each, keyed by machine.

CREATE TABLE machine_provided (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    provider provider NOT NULL,
    provider_id text NOT NULL CHECK (provider_id <> ''),
    provider_address text,
    provider_location text,
    provider_status provider_status NOT NULL DEFAULT 'Unknown',
    UNIQUE (provider, provider_id)
);

CREATE TABLE machine_agent_started (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    agent_started_at timestamptz NOT NULL,
    agent_public_key bytea NOT NULL
);

CREATE TABLE machine_agent_heartbeat (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    agent_heartbeat_at timestamptz NOT NULL
);

CREATE TABLE machine_hardware_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    hardware_report_raw bytea NOT NULL
);

CREATE TABLE machine_os_installation_request (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL,
    os_installation_request_raw bytea NOT NULL
);

CREATE TABLE machine_os_installation_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL,
    os_installation_report_raw bytea NOT NULL
);

-- The Shepherd's SSH trust-on-first-use record of a machine's host key.
CREATE TABLE machine_ssh_host_key (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    public_key bytea NOT NULL,
    first_seen timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION machine_agent_started_mirror() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        UPDATE machines SET agent_started = false WHERE machine_id = OLD.machine_id;
    ELSIF TG_OP = 'INSERT' THEN
        UPDATE machines SET agent_started = true WHERE machine_id = NEW.machine_id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER machine_agent_started_mirror
    AFTER INSERT OR DELETE ON machine_agent_started
    FOR EACH ROW EXECUTE FUNCTION machine_agent_started_mirror();
