package idem

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// maxClaimAttempts bounds how often one request begins a claim transaction:
// only serialization failures and deadlocks (REPEATABLE READ, SERIALIZABLE,
// or the handler's own locks in another transaction) make it try again.
const maxClaimAttempts = 4

// claimResult is the outcome of claiming a key: exactly one of tx (we own
// the key: run the handler), replay (a completed answer) or problem is set.
type claimResult struct {
	tx       driver.Tx
	replay   *stored
	problem  *Problem
	outcome  Outcome
	waited   time.Duration
	tookOver bool // the key's lease-mode claim had run out
}

// errWaitOver ends a duplicate's wait for an original still in flight when
// LockWait runs out: it is answered 409.
var errWaitOver = errors.New("idem: LockWait ran out")

// claim begins the transaction and claims the key. A duplicate of a key in
// flight waits for the original to end, until deadline (LockWait from when
// the key is first found in flight; set here when zero): then it replays the
// original's answer, or, if the original rolled back, claims the key in the
// same transaction, which holds the key's lock by then. Only serialization
// failures and deadlocks begin the claim anew, a bounded number of times.
func (m *Middleware) claim(ctx context.Context, a *driver.Args, deadline time.Time) (res claimResult) {
	storeErr := func(err error) claimResult {
		res.problem, res.outcome = problemFor(fmt.Errorf("%w: %w", ErrUnavailable, err)), OutcomeStoreError
		return res
	}
	var lastErr error
	for attempt := 0; attempt < maxClaimAttempts; attempt++ {
		if err := ctx.Err(); err != nil {
			return storeErr(err)
		}
		begun, err := m.drv.Begin(ctx, a)
		if err != nil {
			switch {
			case retryable(err):
				lastErr = err
				continue
			case driver.SQLState(err) == "55P03":
				// lock_not_available: on a table distributed by Citus the
				// claim's INSERT waited LockWait for an original in flight.
				res.problem, res.outcome = problemFor(ErrInFlight), OutcomeInFlight
				return res
			}
			return storeErr(err)
		}
		if !begun.Won && begun.Row.State == driver.InFlight {
			// Nothing inserted and the lock is taken: in flight.
			begun, err = m.waitForOriginal(ctx, begun.Tx, a, &deadline, &res.waited)
		}
		tx, won, row := begun.Tx, begun.Won, begun.Row
		tookOver := false
		if err == nil && !won {
			switch row.State {
			case driver.LeaseExpired:
				// A lease-mode claim whose lease ran out: a crashed (or
				// frozen) original. Take the key over in this transaction.
				won, err = tx.TakeOver(ctx, a)
				tookOver = won
			case driver.Free, driver.InFlight: // InFlight: never after a wait, which holds the lock
				// No row, and the key's lock is this transaction's: the
				// original rolled back. Claim the key here.
				won, err = tx.Claim(ctx, a)
			default:
				if !begun.Answered { // else read outside a transaction
					_ = tx.Rollback(ctx)
				}
				return m.answerStored(res, row, a.Digest)
			}
		}
		if err == nil && won {
			res.tx, res.tookOver = tx, tookOver
			return res
		}
		if tx != nil { // nil: waitForOriginal gave it back
			_ = tx.Rollback(ctx)
		}
		switch {
		case errors.Is(err, errWaitOver):
			res.problem, res.outcome = problemFor(ErrInFlight), OutcomeInFlight
			return res
		case retryable(err):
			lastErr = err
		case err != nil:
			return storeErr(err)
		default:
			// Under the key's lock no row was visible, and yet the claim
			// inserted none: at REPEATABLE READ or SERIALIZABLE the snapshot
			// can predate the original's commit. A new transaction sees it.
			lastErr = errors.New("idem: the key's row is invisible to the transaction's snapshot")
		}
	}
	res.problem, res.outcome = problemFor(fmt.Errorf("%w: %d attempts: %w", ErrConflict, maxClaimAttempts, lastErr)), OutcomeConflict
	return res
}

// waitForOriginal waits, holding a pooled connection, for the original that
// holds the key's lock to end, and reads the key's row (driver.Tx.Wait). On
// success the lock is the transaction's. At
// most waitLimit claims wait in PostgreSQL at once; the others wait for a
// slot in memory, having given their connection back. When deadline passes
// first, the error is errWaitOver; the Begun's Tx, the transaction to roll
// back, may then be nil.
func (m *Middleware) waitForOriginal(ctx context.Context, tx driver.Tx, a *driver.Args, deadline *time.Time, waited *time.Duration) (begun driver.Begun, err error) {
	if deadline.IsZero() {
		*deadline = time.Now().Add(m.lockWait)
	}
	start := time.Now()
	defer func() { *waited += time.Since(start) }()
	if time.Until(*deadline) <= 0 {
		return driver.Begun{Tx: tx}, errWaitOver
	}
	if m.onPhase != nil {
		var end func(error)
		ctx, end = m.phase(ctx, PhaseWait, Key{Source: a.Source, EventID: a.EventID})
		defer func() {
			cause := err
			if errors.Is(cause, errWaitOver) {
				cause = ErrInFlight
			}
			endPhase(end, cause)
		}()
	}
	limit := waitLimit(m.drv.PoolCap())
	if !m.waiting.tryAcquire(limit) {
		_ = tx.Rollback(ctx)
		if !m.waiting.acquire(ctx, limit, *deadline) {
			if err := ctx.Err(); err != nil {
				return driver.Begun{}, err
			}
			return driver.Begun{}, errWaitOver
		}
		defer m.waiting.release()
		// A new transaction, whose claim finds the key as the last did, or
		// settles it if the original ended meanwhile.
		begun, err := m.drv.Begin(ctx, a)
		if err != nil || begun.Won || begun.Row.State != driver.InFlight {
			return begun, err
		}
		tx = begun.Tx
	} else {
		defer m.waiting.release()
	}
	remaining := time.Until(*deadline)
	if remaining <= 0 {
		return driver.Begun{Tx: tx}, errWaitOver
	}
	row, err := tx.Wait(ctx, a, remaining)
	if driver.SQLState(err) == "55P03" { // lock_not_available: LockWait ran out
		return driver.Begun{Tx: tx}, errWaitOver
	}
	return driver.Begun{Tx: tx, Row: row}, err
}

// answerStored turns a committed row into a replay, a 422, or, for a row
// committed without its answer (a handler that committed the middleware's
// transaction itself), a 409: that key needs an operator.
func (m *Middleware) answerStored(res claimResult, row driver.Row, digest []byte) claimResult {
	switch {
	case row.State == driver.LeaseLive:
		// A lease-mode original is running.
		res.problem, res.outcome = problemFor(ErrInFlight), OutcomeInFlight
		res.problem.leaseLeft = row.LeaseLeft
	case row.State == driver.LeaseExpired || row.State == driver.TakingOver:
		// Its lease ran out while another claim held the key's lock.
		res.problem, res.outcome = problemFor(ErrInFlight), OutcomeInFlight
	case row.State != driver.Completed:
		res.problem, res.outcome = problemFor(fmt.Errorf("%w: the key's row was committed without a response (a handler ended the transaction itself?)", ErrInFlight)), OutcomeInFlight
	case subtle.ConstantTimeCompare(row.Digest, digest) != 1:
		res.problem, res.outcome = problemFor(ErrPayloadMismatch), OutcomeMismatch
	default:
		s := &stored{digest: row.Digest, status: row.Status, body: row.Body}
		if s.body == nil {
			s.body = []byte{} // an empty answer is stored as '', not NULL
		}
		if len(row.Headers) > 0 {
			h, err := parseHeaderJSON(row.Headers)
			if err != nil {
				res.problem, res.outcome = problemFor(fmt.Errorf("%w: stored headers: %w", ErrUnavailable, err)), OutcomeStoreError
				return res
			}
			s.header = h
		}
		res.replay = s
	}
	return res
}

// retryable reports a serialization failure or a deadlock: the claim is
// tried again in a new transaction.
func retryable(err error) bool {
	switch driver.SQLState(err) {
	case "40001", "40P01":
		return true
	}
	return false
}
