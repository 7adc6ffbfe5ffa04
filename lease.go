package idem

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// maxLeaseRetryAfter is the longest Retry-After a duplicate of a key whose
// lease still runs is told to wait (unless Options.RetryAfter is longer):
// the original may be alive and finish long before its lease ends, and
// the retry then gets its answer.
const maxLeaseRetryAfter = time.Minute

// retryAfterHeader is Retry-After for a retryable problem: Options.RetryAfter,
// or, for a duplicate of a key whose lease has left to run, that time, in
// whole seconds rounded up, at least Options.RetryAfter and at most
// maxLeaseRetryAfter (or Options.RetryAfter, if that is longer).
func (m *Middleware) retryAfterHeader(p *Problem) string {
	if p.leaseLeft <= 0 {
		return m.retryAfter
	}
	return seconds(max(m.retryAfterMin, min(p.leaseLeft, maxLeaseRetryAfter)))
}

// seconds renders d as Retry-After does: whole seconds, rounded up.
func seconds(d time.Duration) string {
	return strconv.FormatInt(int64((d+time.Second-1)/time.Second), 10)
}

// releaseTimeout bounds the statement that releases a key after the
// request's own deadline has passed.
const releaseTimeout = 5 * time.Second

// serveLease claims the key in lease mode and runs the handler without a
// transaction held, beginning one only when the handler asks for it.
func (m *Middleware) serveLease(ctx context.Context, x *exchange, key Key) {
	ctx, cancel := context.WithTimeout(ctx, m.handlerTimeout)
	defer cancel()
	claimCtx, endClaim := m.phase(ctx, PhaseClaim, key)
	defer endOnPanic(&endClaim)
	l, p, o := m.claimLease(claimCtx, &x.args)
	endPhase(endClaim, p.cause())
	endClaim = nil
	if p != nil {
		x.fail(o, p)
		return
	}
	if l.replay != nil {
		m.cache.put(key, l.replay, x.start)
		x.replay(l.replay)
		return
	}
	x.obs.TookOver = l.TookOver
	run := &leaseRun{m: m, a: &x.args, token: l.Token}
	run.lazy.begin = func() (driver.LeaseTx, error) { return m.drv.BeginLease(ctx) }
	x.handle(ctx, run, reqState{key: key, lazy: &run.lazy, lease: run})
}

// leaseClaim is the outcome of a lease-mode claim: won (Token), or a
// replay.
type leaseClaim struct {
	driver.Lease
	replay *stored
}

// claimLease claims the key in lease mode. Not won: a completed key is
// replayed (or 422); a key in progress, live, or held by another claim at
// that moment, is answered 409 at once, without waiting.
func (m *Middleware) claimLease(ctx context.Context, a *driver.Args) (leaseClaim, *Problem, Outcome) {
	var lastErr error
	for attempt := 0; attempt < maxClaimAttempts; attempt++ {
		l, err := m.drv.ClaimLease(ctx, a, m.lease, m.lockWait, newToken())
		switch {
		case driver.SQLState(err) == "55P03": // the row stayed locked for LockWait: a completion committing
			return leaseClaim{}, problemFor(ErrInFlight), OutcomeInFlight
		case retryable(err):
			lastErr = err
			continue
		case err != nil:
			return leaseClaim{}, problemFor(fmt.Errorf("%w: %w", ErrUnavailable, err)), OutcomeStoreError
		case l.Won:
			return leaseClaim{Lease: l}, nil, 0
		}
		switch l.Row.State {
		case driver.Completed, driver.Unanswered, driver.LeaseLive:
			res := m.answerStored(claimResult{}, l.Row, a.Digest)
			return leaseClaim{replay: res.replay}, res.problem, res.outcome
		case driver.InFlight, driver.TakingOver:
			// Another claim holds the key's lock: a single-transaction
			// original in flight, or another delivery claiming it now.
			return leaseClaim{}, problemFor(ErrInFlight), OutcomeInFlight
		}
		// No row, or a lease that ran out since the claim looked: the key
		// changed between the two statements. Claim again.
		lastErr = errors.New("idem: the key changed between the lease claim and its lookup")
	}
	return leaseClaim{}, problemFor(fmt.Errorf("%w: %d attempts: %w", ErrConflict, maxClaimAttempts, lastErr)), OutcomeConflict
}

// newToken returns a random fencing token: each claim of a key gets its
// own, so a claim that lost the key can never store an answer for it.
func newToken() int64 {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return int64(binary.BigEndian.Uint64(b[:]) >> 1)
}

// leaseRun ends a lease-mode request: the fenced completion, or the
// release of the key.
type leaseRun struct {
	m     *Middleware
	a     *driver.Args
	token int64
	lazy  lazyTx
	// keep: the handler ended its transaction itself, so its writes may
	// have committed; the key is kept, not released.
	keep bool
}

// extend makes the lease run for Options.Lease again from now, if the token
// still owns the key (ExtendLease). It needs a connection of its own (the
// handler's transaction may hold one): the wait for it is bounded by half
// the lease, so that a full pool fails the heartbeat in time to say so.
func (r *leaseRun) extend(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, r.m.lease/2)
	defer cancel()
	err := r.m.drv.ExtendLease(ctx, r.a, r.token, r.m.lease)
	switch {
	case errors.Is(err, driver.ErrFenced):
		return fmt.Errorf("%w: %w", ErrLeaseExpired, err)
	case err != nil:
		return fmt.Errorf("%w: extending the lease: %w", ErrUnavailable, err)
	}
	return nil
}

// Commit stores the answer, fenced by the token, in the handler's
// transaction if it began one (which commits with it), or on its own.
func (r *leaseRun) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	tx, err := r.lazy.close()
	switch {
	case err != nil:
		return fmt.Errorf("%w: beginning the handler's transaction: %w", ErrUnavailable, err)
	case tx != nil:
		err := tx.Complete(ctx, a, r.token, status, headers, body)
		r.keep = errors.Is(err, driver.ErrTxEnded)
		return err
	}
	return r.m.drv.CompleteLease(ctx, a, r.token, status, headers, body)
}

// Rollback rolls back the handler's transaction, if it began one, and
// releases the key (if the token still owns it and it is not completed),
// so that the next delivery runs at once. When the handler ended its
// transaction itself, the key is kept instead, as a claim without an
// answer: redeliveries get 409, as in single-transaction mode, and
// check reports it.
//
// Its error is only the handler's transaction's: a failure to release the
// key is logged, not returned, since the engine reads a rollback's error as
// the handler's connection lost under it (and answers 503 instead of the
// handler's answer); a handler that never used the database lost nothing.
func (r *leaseRun) Rollback(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	var err error
	if tx, _ := r.lazy.close(); tx != nil {
		err = tx.Rollback(ctx)
	}
	what := "releasing a lease failed; the key's next delivery waits for the lease to run out"
	if r.keep {
		what = "keeping the claim of a handler that ended its transaction failed; the key runs again once its lease runs out"
	}
	if err := r.m.drv.EndLease(ctx, r.a, r.token, r.keep); err != nil {
		r.m.logr().LogAttrs(ctx, slog.LevelError, "idem: "+what,
			slog.String("source", r.a.Source), slog.String("event_id", r.a.EventID), slog.Any("error", err))
	}
	return err
}

// lazyTx is the handler's transaction in lease mode, begun when the
// handler first asks for it.
type lazyTx struct {
	mu     sync.Mutex
	begin  func() (driver.LeaseTx, error)
	tx     driver.LeaseTx
	err    error
	closed bool // the handler returned: no more beginning
}

// handle begins the transaction on first use and returns the handler's
// handle to it, or nil if it could not be begun.
func (l *lazyTx) handle() any {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.tx == nil && l.err == nil && !l.closed {
		l.tx, l.err = l.begin()
	}
	if l.tx == nil {
		return nil
	}
	return l.tx.Handle()
}

// close ends beginning, and returns the transaction (nil if none was
// begun) or the error beginning it.
func (l *lazyTx) close() (driver.LeaseTx, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	return l.tx, l.err
}
