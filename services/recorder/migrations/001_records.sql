-- The recorder's tables: one row per request id. The same SQL runs on PostgreSQL and SQLite.
CREATE TABLE usage (
    request_id        TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    key_id            TEXT NOT NULL,
    model             TEXT NOT NULL,
    revision          TEXT NOT NULL,
    fallback          BOOLEAN NOT NULL,
    api               TEXT NOT NULL,
    finish_reason     TEXT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    cached_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    created           DOUBLE PRECISION NOT NULL,
    finished          DOUBLE PRECISION NOT NULL,
    timing            TEXT NOT NULL,
    recorded          DOUBLE PRECISION NOT NULL
);
CREATE INDEX usage_tenant_finished ON usage (tenant, finished);
CREATE INDEX usage_finished ON usage (finished);

CREATE TABLE requests (
    request_id        TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    worker            TEXT NOT NULL,
    finish_reason     TEXT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    output_tokens     BIGINT NOT NULL,
    error_code        TEXT NOT NULL,
    created           DOUBLE PRECISION NOT NULL,
    ended             DOUBLE PRECISION NOT NULL,
    recorded          DOUBLE PRECISION NOT NULL
);
CREATE INDEX requests_tenant_created ON requests (tenant, created);
