-- Agent heartbeats as the agent callback server writes them.
--
-- agent_request_time_ns is the (signed) time of the last accepted heartbeat
-- request, in nanoseconds since the epoch on the agent's clock. The server
-- accepts a request only if its time is newer, in the same statement that
-- writes the heartbeat, so a captured request cannot be replayed, even
-- across server restarts or between several servers.
ALTER TABLE machine_agent_heartbeat ADD COLUMN agent_request_time_ns bigint NOT NULL DEFAULT 0;

-- Every accepted heartbeat updates its row. No index covers the updated
-- columns (on purpose: the recovery source scans the started machines,
-- whose number is the fleet's), so with room left on each page the updates
-- stay HOT: no index writes, and pages are pruned without vacuum.
ALTER TABLE machine_agent_heartbeat SET (fillfactor = 50);
