// Package idem makes webhook and API handlers run exactly once on
// PostgreSQL: providers deliver at least once, often concurrently, and idem
// turns that into one side effect per event and the same answer for every
// redelivery.
//
//	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe(secret)}) // db: *sql.DB on pgx; secret: "whsec_..."
//	r.Use(mw.Handler)                                                  // chi, gorilla/mux; or mw.Handler(h)
//	tx, ok := idem.Tx(r.Context())                                     // in the handler: write through tx
//
// For a pgx pool (handlers that take a pgx.Tx, such as sqlc's pgx/v5 mode),
// package github.com/pgidem/idem/idempgx builds the same middleware on the
// same table, and sends fewer round trips.
//
// Two adapters are modules of their own, so that gin and the Prometheus
// client stay off this module's requirements: github.com/pgidem/idem/idemgin
// mounts the middleware in a gin router so that clients get exactly the
// answers idem committed, and github.com/pgidem/idem/idemprom turns
// Options.Observer into Prometheus metrics.
//
//	go get github.com/pgidem/idem@latest
//	go get github.com/pgidem/idem/idemgin@latest
//	go get github.com/pgidem/idem/idemprom@latest
//
// This package imports only the standard library; idempgx imports pgx.
//
// For each request with a covered method (POST, PUT, PATCH, DELETE by
// default) the middleware reads the body (bounded by Options.MaxBodyBytes),
// extracts a Key with the KeyFunc (the presets scope it by endpoint: the
// request's method and path), begins a transaction and claims the key
// under a transaction-level advisory lock of the key, taken without
// waiting: the lock tells a duplicate at once that the original is still
// in flight, and the primary key (source, event_id) decides who owns the
// key. The handler runs with the transaction in its context (Tx), so its
// business writes commit or roll back together with the claim. Its answer
// is buffered; a final answer (2xx by default) is stored in the key's row
// and committed, and only then sent. Anything else (another status, a
// panic, a timeout, a database error) rolls everything back, so the
// sender's retry runs the handler again: failures are never cached.
//
// A duplicate of a completed key gets the stored status, allow-listed
// headers and exact body bytes, with Idempotent-Replayed: true, without
// running the handler. A duplicate of a key still in flight waits at most
// Options.LockWait for the original, then replays its answer, runs in its
// place if the original rolled back, or gets 409 with Retry-After.
// Duplicates of one key on one instance wait in memory, holding no pooled
// connection. A key reused with a different body gets 422. Bad input
// gets 400 or 413, and a webhook signature that does not verify (the
// provider presets check it when given the endpoint's secrets) gets 401;
// neither leaves anything behind; a database that fails gets 503
// with Retry-After. The middleware never answers 410, which Standard
// Webhooks senders take as "disable this endpoint". Its own error answers
// are small application/problem+json documents (see WriteProblem and
// Options.ErrorHandler).
//
// Deliveries that do not come over HTTP, a queue consumer's messages above
// all, take the same claim through Middleware.Do: it runs a function at
// most once to completion per key, its writes through Tx committed with the
// claim and the value it returns; a redelivery gets that value back.
// Retryable tells a consumer which of Do's errors are worth a redelivery
// (docs/consumers.md).
//
// The table is created by Migrate; sweeping it, checking it and counting
// its keys are in package idemops (and the idem command, cmd/idem).
// README.md has the behaviour table and a
// production checklist; docs/ has how a claim works statement by statement
// (on database/sql and on pgx), the schema, the problem types, retention
// and operations.
//
// Effects the database cannot roll back (an email, a call to another API)
// do not belong inside the handler's transaction: write an outbox row (or
// enqueue a job with a transactional queue such as River) through Tx, and
// perform it after commit.
package idem
