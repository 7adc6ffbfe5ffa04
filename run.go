package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// finisher ends a claimed request: a driver.Tx in single-transaction mode,
// a leaseRun in lease mode.
type finisher interface {
	// Commit stores the answer and commits; an error means nothing was.
	Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error
	// Rollback rolls back whatever is open and gives up the key.
	Rollback(ctx context.Context) error
}

// run calls the handler with state in its context, then commits its answer
// or rolls everything back, all within ctx's deadline (HandlerTimeout from
// the claim).
func (m *Middleware) run(ctx context.Context, x *exchange, tx finisher, state reqState, body []byte, next http.Handler) {
	finished := false
	var endHandler func(error)
	defer func() {
		if !finished { // the handler panicked: the panic goes on, nothing is sent
			err := errors.New("idem: handler panicked")
			endPhase(endHandler, err)
			_ = tx.Rollback(ctx)
			x.obs.Outcome, x.obs.Err = OutcomeRolledBack, err
			x.observe()
		}
	}()

	rec := newRecorder(x.w, m.maxResponse)
	rec.onLate = func() { m.log(x, slog.LevelError, "write after the handler returned, ignored", ErrWriteAfterReturn) }
	abandoned := false // a COMMIT still running reads the answer's bytes: they are not recycled
	defer func() {
		switch {
		case finished && abandoned:
			rec.retire()
		case finished:
			rec.release()
		}
	}()
	x.state = state
	hctx, endHandler := m.phase(ctx, PhaseHandler, x.obs.Key)
	r2 := x.r.WithContext(context.WithValue(hctx, ctxKey{}, &x.state))
	x.body.Reset(body)
	r2.Body = &x.body
	r2.ContentLength = int64(len(body))
	next.ServeHTTP(rec, r2)
	finished = true
	endPhase(endHandler, nil)

	status := rec.finalStatus()
	kind := rpcKindOf(rec.header) // a gRPC answer is 200 whatever its outcome
	final := m.finalStatus(status) && (kind == rpcNone || rpcSucceeded(kind, rec.header, rec.body.Bytes()))
	var headers []byte // the stored headers are part of the answer's size
	switch {
	case final && (kind == rpcGRPC || kind == rpcGRPCWeb):
		headers = rpcStoredHeaders(make([]byte, 0, 128), rec.header, m.replayHeaders)
	case final:
		headers = appendHeaderJSON(make([]byte, 0, 64), rec.header, m.replayHeaders)
	}
	switch {
	case ctx.Err() != nil:
		// Past HandlerTimeout, whatever the handler answered (often its
		// own error about the deadline): roll back and say so, with
		// Retry-After, so the sender retries.
		_ = tx.Rollback(ctx)
		x.fail(OutcomeRolledBack, problemFor(fmt.Errorf("%w: the handler returned %d after %v", ErrHandlerTimeout, status, m.handlerTimeout)))
		return
	case rec.overflow || len(headers)+rec.body.Len() > m.maxResponse:
		_ = tx.Rollback(ctx)
		x.fail(OutcomeRolledBack, problemFor(ErrResponseTooLarge))
		return
	case !final:
		// Not final: roll back the claim and the handler's writes, so the
		// sender's retry runs again; send the handler's answer as it is.
		if err := tx.Rollback(ctx); errors.Is(err, driver.ErrConnLost) && ctx.Err() == nil {
			// The claim's connection died under the handler (a failover,
			// a terminated backend): its answer is most likely about that.
			// A store failure, answered 503 with Retry-After.
			x.fail(OutcomeStoreError, connectionLost(status, err))
			return
		}
		x.obs.Outcome, x.obs.Err = OutcomeRolledBack, fmt.Errorf("idem: handler answered %d, not a final status", status)
		if kind != rpcNone && m.finalStatus(status) {
			x.obs.Err = errors.New("idem: the handler's RPC answer is not a success (or its status cannot be read)")
		}
		m.log(x, slog.LevelInfo, "rolled back: the handler's status is not final", x.obs.Err)
		x.answer(rec)
		return
	}

	answer := rec.body.Bytes()
	if answer == nil {
		answer = []byte{} // an empty answer is stored as '', not NULL
	}
	if err := m.commit(ctx, x, tx, status, headers, answer); err != nil {
		abandoned = errors.Is(err, errCommitPending)
		p, o := m.finishProblem(ctx, err)
		x.fail(o, p)
		return
	}
	x.obs.Outcome = OutcomeCompleted
	x.answer(rec)
}

// errCommitPending: HandlerTimeout passed while the COMMIT was still
// waiting for its answer, typically for a synchronous standby to confirm.
var errCommitPending = errors.New("idem: the COMMIT had not answered by the deadline; it goes on, and the key stays in flight until it ends")

// commit stores the answer and commits, or rolls back if that fails, and
// returns when the COMMIT answers or ctx ends, whichever comes first.
//
// The COMMIT itself is never cancelled: the adapters send it on a context
// that does not end. A COMMIT that waits for a synchronous standby and is
// cancelled (a CancelRequest, which pgx sends when a context ends during a
// query, with either of its context watchers) commits locally anyway,
// unreplicated, and PostgreSQL reports it as a success with only a
// WARNING: the event would be answered 2xx, and replayed 2xx to its
// redeliveries, though a failover would lose it. So when ctx ends first, the answer is 503 and the
// COMMIT goes on in the background, holding its connection and the key's
// lock (duplicates are answered 409) until the standby confirms (a
// redelivery then gets the stored answer) or the primary goes away (the key
// is free again on the new primary). See docs/durability.md.
func (m *Middleware) commit(ctx context.Context, x *exchange, tx finisher, status int, headers, answer []byte) (err error) {
	if err := ctx.Err(); err != nil { // the handler returned past its deadline
		_ = tx.Rollback(ctx)
		return err
	}
	commitCtx, endCommit := m.phase(ctx, PhaseCommit, x.obs.Key)
	if endCommit != nil {
		defer func() {
			cause := err
			if err != nil { // named as the answer names it: ErrLeaseExpired, ErrUnavailable, ...
				p, _ := m.finishProblem(ctx, err)
				cause = p.Err
			}
			endCommit(cause)
		}()
	}
	c := &pendingCommit{m: m, ctx: commitCtx, tx: tx, args: x.args, key: x.obs.Key, method: x.obs.Method,
		status: status, headers: headers, answer: answer, done: make(chan error, 1)}
	startCommit(c)
	select {
	case err = <-c.done:
	case <-ctx.Done():
		if c.state.CompareAndSwap(commitRunning, commitAbandoned) {
			return fmt.Errorf("%w: %w", errCommitPending, ctx.Err())
		}
		err = <-c.done // it answered just now
	}
	if p, ok := err.(commitPanic); ok {
		panic(p.v)
	}
	return err
}

// pendingCommit is a COMMIT on its own goroutine, with all it needs, which
// may outlive its request.
type pendingCommit struct {
	m               *Middleware
	ctx             context.Context
	tx              finisher
	args            driver.Args
	key             Key
	method          string
	status          int
	headers, answer []byte
	state           atomic.Int32 // commitRunning, then commitAnswered or commitAbandoned
	done            chan error
}

func (c *pendingCommit) run() {
	var err error
	defer func() {
		if p := recover(); p != nil { // a driver's hook: panic on the request's goroutine
			_ = c.tx.Rollback(c.ctx)
			err = commitPanic{p}
		}
		if c.state.CompareAndSwap(commitRunning, commitAnswered) {
			c.done <- err
		} else {
			c.m.logLateCommit(c.key, c.method, err)
		}
	}()
	if err = c.tx.Commit(c.ctx, &c.args, c.status, c.headers, c.answer); err != nil {
		_ = c.tx.Rollback(c.ctx)
	}
}

// commitWorkers hands a COMMIT to a goroutine waiting for one (commit runs
// each on a goroutine of its own, so that its request can be answered at
// its deadline while the COMMIT goes on). A goroutine that has run a COMMIT
// waits commitWorkerIdle for the next one before it exits: under load the
// COMMITs reuse a few goroutines whose stacks have already grown to what a
// COMMIT needs, instead of starting, and growing, one per request (a tenth
// of the process's CPU time in a profile of the load tool).
var commitWorkers = make(chan *pendingCommit)

const commitWorkerIdle = 100 * time.Millisecond

// startCommit runs c on a waiting goroutine, or on a new one.
func startCommit(c *pendingCommit) {
	select {
	case commitWorkers <- c:
	default:
		go commitWorker(c)
	}
}

func commitWorker(c *pendingCommit) {
	idle := time.NewTimer(commitWorkerIdle)
	defer idle.Stop()
	for {
		c.run()
		idle.Reset(commitWorkerIdle)
		select {
		case c = <-commitWorkers:
		case <-idle.C:
			return
		}
	}
}

// commitPanic carries a panic of the COMMIT's goroutine to the request's.
type commitPanic struct{ v any }

func (p commitPanic) Error() string { return fmt.Sprint("idem: the COMMIT panicked: ", p.v) }

// The states of a COMMIT that commit waits for.
const (
	commitRunning int32 = iota
	commitAnswered
	commitAbandoned
)

// logLateCommit logs how a COMMIT ended after its request was answered 503.
func (m *Middleware) logLateCommit(key Key, method string, err error) {
	level, msg := slog.LevelWarn, "idem: a COMMIT answered 503 for its deadline completed afterwards; redeliveries get its stored answer"
	if err != nil {
		level, msg = slog.LevelError, "idem: a COMMIT answered 503 for its deadline ended afterwards with an error"
	}
	if method == "" { // a call of Do
		level, msg = slog.LevelWarn, "idem: a COMMIT whose Do call returned ErrHandlerTimeout completed afterwards; redeliveries get its stored answer"
		if err != nil {
			level, msg = slog.LevelError, "idem: a COMMIT whose Do call returned ErrHandlerTimeout ended afterwards with an error"
		}
	}
	m.logr().LogAttrs(context.Background(), level, msg,
		slog.String("source", key.Source), slog.String("event_id", key.EventID),
		slog.String("method", method), slog.Any("error", err))
}

// connectionLost is the problem of a claim whose rollback found its
// connection lost (driver.ErrConnLost) after the handler answered status
// (not final, or, for Do, an error: 0): the claim's connection died while
// the handler ran, so the store failed, whatever the handler made of it.
// Nothing was committed. Any other rollback failure leaves the handler's
// answer.
func connectionLost(status int, err error) *Problem {
	what := fmt.Sprintf("the handler answered %d", status)
	if status == 0 {
		what = "fn returned an error"
	}
	return problemFor(fmt.Errorf("%w: the connection was lost while the handler ran (%s): %w", ErrUnavailable, what, err))
}

// finishProblem names why storing the answer or committing failed.
func (m *Middleware) finishProblem(ctx context.Context, err error) (*Problem, Outcome) {
	switch {
	case errors.Is(err, driver.ErrFenced):
		return problemFor(fmt.Errorf("%w: %w", ErrLeaseExpired, err)), OutcomeFenced
	case ctx.Err() != nil:
		return problemFor(fmt.Errorf("%w: %w", ErrHandlerTimeout, err)), OutcomeRolledBack
	case errors.Is(err, driver.ErrTxDone):
		return problemFor(fmt.Errorf("%w: %w", ErrTxMisuse, err)), OutcomeRolledBack
	case driver.SQLState(err) == "25P02": // in_failed_sql_transaction
		return problemFor(fmt.Errorf("%w: %w", ErrTxAborted, err)), OutcomeRolledBack
	}
	return problemFor(fmt.Errorf("%w: %w", ErrUnavailable, err)), OutcomeStoreError
}
