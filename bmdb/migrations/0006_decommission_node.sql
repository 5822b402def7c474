-- Decommissioning a cluster node (issue 27, item 2): before the wipe, the
-- decommissioner removes from the cluster the node the machine's current
-- successful installation report names (its roles revoked, then deleted
-- with the owner's credentials), and records it here: a retry does not
-- remove it again, and the tombstone tells which node it was.
ALTER TABLE machine_decommission
    ADD COLUMN node_id text,
    ADD COLUMN node_removed_at timestamptz,
    ADD COLUMN node_removal text,
    ADD CHECK ((node_removed_at IS NULL) = (node_removal IS NULL)),
    ADD CHECK ((node_removed_at IS NULL) = (node_id IS NULL));
