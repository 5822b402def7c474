-- The OS installation flow (issue 25): the few fields of a request and of a
-- report that the views and the metrics need, as columns beside the raw
-- protobuf bytes, so that the BMDB reads them without decoding the agent
-- callback's messages (it imports nothing of the Shepherd's).
--
-- Nullable: rows written before this migration carry only their raw bytes;
-- everything written since fills the columns (Queries.set_os_installation_request,
-- Queries.record_os_installation_report).

ALTER TABLE machine_os_installation_request
    ADD COLUMN root_device text,
    -- "sha256:<64 hex>", as in the request's OSImageRef.
    ADD COLUMN image_digest text,
    -- The machine's own address the node is started with.
    ADD COLUMN node_address text,
    ADD COLUMN requested_at timestamptz NOT NULL DEFAULT now();

ALTER TABLE machine_os_installation_report
    -- NULL for a row without the outcome (written before this migration).
    ADD COLUMN success boolean,
    -- The agent's one line on a failure.
    ADD COLUMN cause text,
    -- Raw Ed25519 public key of the installed node (32 bytes).
    ADD COLUMN node_public_key bytea,
    ADD COLUMN reported_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT os_installation_report_outcome CHECK (
        success IS NULL
        OR (success AND cause IS NULL)
        OR (NOT success AND cause IS NOT NULL AND node_public_key IS NULL)),
    ADD CONSTRAINT os_installation_report_key CHECK (
        node_public_key IS NULL OR octet_length(node_public_key) = 32);
