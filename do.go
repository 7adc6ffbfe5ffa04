package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Result is what Do returns for a key it completed, or found completed.
type Result struct {
	// Value is what fn returned, now or the first time: the stored
	// answer's body. An empty Value and a nil one are stored alike and
	// replayed as empty.
	Value []byte
	// Replayed: fn did not run; Value is the stored one.
	Replayed bool
	// RetryAfter is set when Do fails with an error Retryable reports
	// true for, other than fn's own: how long to wait before a redelivery
	// is likely to find the key free. For a key whose lease-mode original
	// is running, its lease's time left (the original may finish sooner);
	// otherwise Options.RetryAfter. A consumer can hold the message that
	// long (not acked, kept alive) and then retry once, instead of
	// spending the broker's redelivery budget on a key that is in flight.
	RetryAfter time.Duration
}

// Do runs fn at most once to completion for key, with payload's SHA-256 as
// the key's digest, and returns what fn returned, or, for a key already
// completed with the same payload, what it returned then (Result.Replayed).
// It is the entry point for deliveries that do not come over HTTP, a queue
// consumer's messages above all: the broker redelivers at least once, and
// key decides whether a delivery runs.
//
// Inside fn, Tx (or idempgx.Tx) returns the claim's transaction, as for an
// HTTP handler: fn's writes, the claim and Value commit together, and Do
// returns only after COMMIT. Never call Commit or Rollback on it. In lease
// mode (Options.Lease) the transaction is begun when fn first asks for it.
//
// Do takes the same path as Handler: the replay cache, one delivery of a
// key at a time on this instance, the claim with its wait (LockWait) for an
// original in flight and its takeover of an original that failed, lease
// mode with its fencing, partitioned tables, HandlerTimeout and the
// Observer, which sees each call with an empty Observation.Method. It
// neither needs nor uses Options.KeyFunc, Methods, FinalStatus,
// ReplayHeaders, ErrorHandler or RetryAfter.
//
// What it stores: status 200, no headers, Value as the body. So a key that
// HTTP and Do share (the same Source) gives one answer: an HTTP delivery
// of a key Do completed is answered 200 with Value as its body, and Do on
// a key an HTTP handler completed returns that response's body, Replayed.
//
// payload is bounded by Options.MaxBodyBytes and Value, with the two bytes
// of its stored headers ({}), by Options.MaxResponseBytes.
//
// Errors: nil with a Result when fn's effect is committed, now or before.
// Otherwise the error wraps fn's own error (fn returned it: everything was
// rolled back and nothing stored, so a redelivery runs fn again) or one of
// ErrInvalidKey, ErrBodyTooLarge, ErrInFlight, ErrPayloadMismatch,
// ErrConflict, ErrUnavailable, ErrHandlerTimeout, ErrLeaseExpired,
// ErrTxAborted, ErrTxMisuse, ErrResponseTooLarge; each one's doc comment
// says whether fn's effect may have committed. A redelivery of the same key
// and payload is always safe: if the effect committed, it is a replay.
// Retryable tells the errors worth a redelivery from those that are not.
//
// ctx's values reach fn. When ctx is cancelled or its deadline passes, Do
// ends: while fn runs, as at HandlerTimeout (rolled back, unless the COMMIT
// was already sent; ErrHandlerTimeout); while it waits for another
// delivery of the key, with ErrInFlight (waiting on this instance) or
// ErrUnavailable (waiting in PostgreSQL). Each error wraps ctx's too
// (errors.Is(err, context.Canceled)). A panic in fn rolls everything back
// and goes on from Do. fn must not be nil.
func (m *Middleware) Do(ctx context.Context, key Key, payload []byte, fn func(ctx context.Context) ([]byte, error)) (Result, error) {
	if fn == nil {
		panic("idem: Do needs a function to run")
	}
	x := &exchange{m: m, call: &doCall{ctx: ctx, fn: fn}, payload: payload, start: time.Now()}
	x.obs.Context = ctx
	if err := validateKey(key); err != nil {
		if errors.Is(err, ErrNoKey) { // for Do, an empty key is an invalid one
			err = fmt.Errorf("%w: %s", ErrInvalidKey, strings.TrimPrefix(err.Error(), ErrNoKey.Error()+": "))
		}
		x.fail(OutcomeRejected, problemFor(err))
		return x.call.res, x.call.err
	}
	x.obs.Key = key
	if int64(len(payload)) > m.maxBody {
		x.fail(OutcomeRejected, problemFor(ErrBodyTooLarge))
		return x.call.res, x.call.err
	}
	m.deliver(ctx, x, key)
	return x.call.res, x.call.err
}

// doCall is a call of Do: its function, and what it returns.
type doCall struct {
	ctx context.Context // the caller's, for the log records
	fn  func(ctx context.Context) ([]byte, error)
	res Result
	err error
}

// doHeaders are the stored headers of Do's answers: none.
var doHeaders = []byte("{}")

// runDo calls Do's function with state in its context, then commits its
// Value or rolls everything back, all within ctx's deadline
// (HandlerTimeout from the claim, or the caller's own if sooner). It is
// run's counterpart for Do.
func (m *Middleware) runDo(ctx context.Context, x *exchange, tx finisher, state reqState) {
	finished := false
	var endHandler func(error)
	defer func() {
		if !finished { // fn panicked: the panic goes on
			err := errors.New("idem: handler panicked")
			endPhase(endHandler, err)
			_ = tx.Rollback(ctx)
			x.obs.Outcome, x.obs.Err = OutcomeRolledBack, err
			x.observe()
		}
	}()
	x.state = state
	fnCtx, endHandler := m.phase(ctx, PhaseHandler, x.obs.Key)
	value, err := x.call.fn(context.WithValue(fnCtx, ctxKey{}, &x.state))
	finished = true
	endPhase(endHandler, err)

	switch {
	case ctx.Err() != nil:
		// Past its deadline, whatever fn returned (often its own error
		// about the deadline): roll back and say so.
		_ = tx.Rollback(ctx)
		cause := fmt.Errorf("%w: fn returned after its deadline (HandlerTimeout %v, or ctx's): %w", ErrHandlerTimeout, m.handlerTimeout, context.Cause(ctx))
		if err != nil {
			cause = fmt.Errorf("%w; fn returned: %w", cause, err)
		}
		x.fail(OutcomeRolledBack, problemFor(cause))
		return
	case err != nil:
		// fn's own error: roll back the claim and fn's writes, so that a
		// redelivery runs fn again.
		if rbErr := tx.Rollback(ctx); errors.Is(rbErr, driver.ErrConnLost) && ctx.Err() == nil {
			x.fail(OutcomeStoreError, connectionLost(0, fmt.Errorf("%w; fn returned: %w", rbErr, err)))
			return
		}
		x.obs.Outcome, x.obs.Err = OutcomeRolledBack, fmt.Errorf("idem: fn failed and was rolled back: %w", err)
		m.log(x, slog.LevelInfo, "rolled back: fn returned an error", x.obs.Err)
		x.observe()
		x.call.err = x.obs.Err
		return
	case len(doHeaders)+len(value) > m.maxResponse:
		_ = tx.Rollback(ctx)
		x.fail(OutcomeRolledBack, problemFor(fmt.Errorf("%w: fn returned %d bytes", ErrResponseTooLarge, len(value))))
		return
	}
	answer := value
	if answer == nil {
		answer = []byte{} // an empty answer is stored as '', not NULL
	}
	if err := m.commit(ctx, x, tx, http.StatusOK, doHeaders, answer); err != nil {
		p, o := m.finishProblem(ctx, err)
		x.fail(o, p)
		return
	}
	x.obs.Outcome, x.obs.Status = OutcomeCompleted, http.StatusOK
	x.observe()
	x.call.res = Result{Value: value}
}

// replayDo is replay for a call of Do: the stored body, in a copy of its
// own (the replay cache keeps the stored one).
func (x *exchange) replayDo(s *stored) {
	x.obs.Outcome, x.obs.Status = OutcomeReplayed, s.status
	x.observe()
	x.call.res = Result{Value: bytes.Clone(s.body), Replayed: true}
}

// Retryable reports whether a redelivery of what err failed could succeed
// later, for a consumer to choose: nil err, ack; Retryable, retry later
// (nack, requeue, redeliver after a delay); otherwise, dead-letter (or
// drop, logged). A redelivery is always safe (a key whose effect committed
// is replayed), so Retryable is about usefulness, not safety.
//
// It is false for the errors a redelivery would meet again: ErrInvalidKey,
// ErrNoKey, ErrBodyTooLarge, ErrPayloadMismatch, ErrResponseTooLarge,
// ErrTxMisuse, ErrSignature, ErrBadBody and ErrPartitionedIsolation (and
// for nil). It is true for the others: ErrInFlight, ErrConflict,
// ErrUnavailable, ErrHandlerTimeout, ErrLeaseExpired, ErrTxAborted, and
// any error of fn's own, which idem cannot judge: test for your own
// permanent errors (with errors.Is or errors.As) before calling Retryable.
func Retryable(err error) bool {
	if err == nil {
		return false
	}
	for _, permanent := range []error{ErrInvalidKey, ErrNoKey, ErrBodyTooLarge, ErrPayloadMismatch,
		ErrResponseTooLarge, ErrTxMisuse, ErrSignature, ErrBadBody, ErrPartitionedIsolation} {
		if errors.Is(err, permanent) {
			return false
		}
	}
	return true
}
