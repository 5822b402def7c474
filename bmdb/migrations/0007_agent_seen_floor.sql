-- The recovery source without a walk over the fleet (issue 30).
--
-- The recovery source looks for started agents gone silent: no heartbeat
-- row and started long ago, or a heartbeat row older than the timeout.
-- The heartbeat time has no index on purpose (migration 0002: heartbeats
-- stay HOT updates), so with none silent the source used to walk every
-- started machine, a heartbeat probe each: about 720,000 buffers and 2 to
-- 3 s at 100,000 machines, for every recoverer's every claim attempt.
--
-- agent_seen_floor is a lower bound on the time the source compares with
-- now(): the last heartbeat, or the start if there was none yet, rounded
-- down to 5 minutes. A machine is silent only if its floor is older than
-- the timeout, so the source reads the few machines below that bound from
-- an index and checks each against its exact heartbeat; a live machine's
-- floor is at most 5 minutes and a heartbeat interval old, never below a
-- 10-minute timeout. Each machine's 5 minutes start at an offset of its
-- own (from its id), so that the fleet's heartbeats cross into the next
-- 5 minutes spread over them, not all in the same heartbeat interval.
--
-- The column lives on machine_agent_started, not on the heartbeat row: the
-- heartbeat table keeps no index on what heartbeats write, and its updates
-- stay HOT (tests/bmdb/test_heartbeat_hot.py). A heartbeat writes the
-- floor only when it crosses into the machine's next 5 minutes: one
-- heartbeat in 30 at the default 10-second interval.
--
-- Triggers keep the bound true for every writer (the heartbeat statement,
-- the test and bench helpers that write times of their choosing, the
-- recoverer deleting a heartbeat): the floor is that of the heartbeat if
-- there is one, else of the start.

-- Immutable throughout (to_timestamp, not timestamptz + interval, which is
-- only stable), so that it is inlined where it is used: in the heartbeat
-- trigger's WHEN, evaluated for every heartbeat.
CREATE FUNCTION agent_seen_floor(at timestamptz, machine uuid) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN date_bin('5 minutes', at, to_timestamp(
        -- 2000-01-01 UTC, plus the machine's offset of 0 to 299 seconds.
        946684800 + (get_byte(uuid_send(machine), 14) * 256
                     + get_byte(uuid_send(machine), 15)) % 300));

ALTER TABLE machine_agent_started ADD COLUMN agent_seen_floor timestamptz;
UPDATE machine_agent_started a SET agent_seen_floor = agent_seen_floor(coalesce(
    (SELECT h.agent_heartbeat_at FROM machine_agent_heartbeat h WHERE h.machine_id = a.machine_id),
    a.agent_started_at), a.machine_id);
ALTER TABLE machine_agent_started ALTER COLUMN agent_seen_floor SET NOT NULL;
CREATE INDEX machine_agent_started_seen ON machine_agent_started (agent_seen_floor, machine_id);

CREATE FUNCTION machine_agent_started_floor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.agent_seen_floor := agent_seen_floor(coalesce(
        (SELECT h.agent_heartbeat_at FROM machine_agent_heartbeat h
         WHERE h.machine_id = NEW.machine_id),
        NEW.agent_started_at), NEW.machine_id);
    RETURN NEW;
END
$$;

CREATE TRIGGER machine_agent_started_floor
    BEFORE INSERT OR UPDATE OF agent_started_at ON machine_agent_started
    FOR EACH ROW EXECUTE FUNCTION machine_agent_started_floor();

CREATE FUNCTION machine_agent_heartbeat_floor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        UPDATE machine_agent_started
        SET agent_seen_floor = agent_seen_floor(agent_started_at, machine_id)
        WHERE machine_id = OLD.machine_id;
    ELSE
        UPDATE machine_agent_started
        SET agent_seen_floor = agent_seen_floor(NEW.agent_heartbeat_at, NEW.machine_id)
        WHERE machine_id = NEW.machine_id
          AND agent_seen_floor
              IS DISTINCT FROM agent_seen_floor(NEW.agent_heartbeat_at, NEW.machine_id);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER machine_agent_heartbeat_floor
    AFTER INSERT OR DELETE ON machine_agent_heartbeat
    FOR EACH ROW EXECUTE FUNCTION machine_agent_heartbeat_floor();

-- Evaluated per heartbeat without calling the function: it runs only when
-- the heartbeat crosses into the next 5 minutes.
CREATE TRIGGER machine_agent_heartbeat_floor_moved
    AFTER UPDATE OF agent_heartbeat_at ON machine_agent_heartbeat
    FOR EACH ROW
    WHEN (agent_seen_floor(NEW.agent_heartbeat_at, NEW.machine_id)
          IS DISTINCT FROM agent_seen_floor(OLD.agent_heartbeat_at, OLD.machine_id))
    EXECUTE FUNCTION machine_agent_heartbeat_floor();
