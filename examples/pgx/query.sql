-- name: RecordPayment :one
INSERT INTO payments (event_id, amount, currency)
VALUES ($1, $2, $3)
RETURNING id;

-- name: CountPayments :one
SELECT count(*) FROM payments;
