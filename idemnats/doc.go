// Package idemnats runs a NATS JetStream consumer's handler exactly once
// per message on PostgreSQL with idem: the claim of the message's key, the
// handler's writes and the stored outcome commit in one transaction, and
// the message is acked only after that commit.
//
//	mw, err := idem.New(db, idem.Options{}) // or idempgx.New(pool, ...); no KeyFunc needed
//	c, err := idemnats.New(mw, cons, func(ctx context.Context, msg jetstream.Msg) error {
//		tx, _ := idem.Tx(ctx) // idempgx.Tx(ctx) with idempgx
//		_, err := tx.ExecContext(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, string(msg.Data()))
//		return err
//	})
//	cc, err := cons.Consume(c.Handle)
//
// cons must be a durable consumer with AckExplicit. A message's key is its
// Nats-Msg-Id header, or its stream, the consumer's creation time and its
// stream sequence, under the source
// "nats:<stream>/<durable>"; a redelivery, to this process or another, of
// a message whose handler committed is acked without running it again.
//
// What each outcome of idem.Middleware.Do makes of the message:
//
//	outcome                                   answer to JetStream
//	committed now                             Ack
//	replayed (committed before)               Ack
//	handler error, or panic (recovered)       NakWithDelay(WithRetryDelay, 1s), logged
//	idem.ErrInFlight                          held with InProgress() for Result.RetryAfter,
//	                                          then Do once more; if still not done:
//	idem.Retryable errors                     NakWithDelay(Result.RetryAfter), logged
//	ErrPayloadMismatch, ErrInvalidKey,        Term, logged
//	ErrBodyTooLarge, other permanent errors,
//	a panic in WithDigest's function
//	stored longer ago than the retention      Term, logged, never run
//
// Handlers that run longer than the consumer's AckWait keep their message
// with InProgress() every AckWait/2; in lease mode (idem.Options.Lease) the
// same beat extends the key's lease (idem.ExtendLease): pass the lease with
// WithLease, and the beat is at most a third of it. See docs/nats.md.
package idemnats
