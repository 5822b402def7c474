-- What an agent finds of the installation it made, after it made it (issue 36).
--
-- An agent that installed onto a real disk reads the boot record back at
-- every heartbeat; when it starts (after a reboot, say) and whenever what it
-- finds changes, it reports on the generation installed, unasked: still
-- there (the node's key again), or gone (a disk emptied, wiped or written
-- over behind the Shepherd's back), with the cause. The report of the
-- install itself stays as it was (its success and the node's key: the
-- decommissioner still finds the node to remove); beside it:
--   checked_at   when the agent last reported on the installed generation
--   lost_cause   why it is gone; NULL while it is there. Such a machine is
--                'install-lost' in the views, not 'installed'.
ALTER TABLE machine_os_installation_report
    ADD COLUMN checked_at timestamptz,
    ADD COLUMN lost_cause text,
    ADD CONSTRAINT os_installation_report_lost CHECK (lost_cause IS NULL OR success);
