-- The payments that the receiver records, one per Stripe event. The
-- middleware already runs the handler once per event id; the UNIQUE
-- constraint states the same rule in the schema.
CREATE TABLE IF NOT EXISTS payments (
    id         bigserial   PRIMARY KEY,
    event_id   text        NOT NULL UNIQUE,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
