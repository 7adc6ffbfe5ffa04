package idem

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Middleware makes handlers idempotent; build it with New and wrap handlers
// with its Handler method, or run a function once per key with its Do
// method. It is safe for concurrent use.
type Middleware struct {
	drv            driver.Driver
	table          table
	keyFunc        KeyFunc
	lockWait       time.Duration
	methods        []string
	maxBody        int64
	maxResponse    int
	finalStatus    func(int) bool
	replayHeaders  []string
	retryAfter     string        // Retry-After, in seconds
	retryAfterMin  time.Duration // Options.RetryAfter, or its default
	handlerTimeout time.Duration
	lease          time.Duration // > 0: lease mode
	logger         *slog.Logger
	errorHandler   func(http.ResponseWriter, *http.Request, *Problem)
	observer       func(Observation)
	onPhase        func(context.Context, Phase, Key) (context.Context, func(error))
	cache          *replayCache
	flights        flights   // the deliveries of each key running on this instance
	waiting        waitSlots // claims waiting in PostgreSQL for an original
}

// New validates opts and returns a Middleware that claims keys in db, which
// must be a PostgreSQL database (tested with github.com/jackc/pgx/v5/stdlib)
// where Migrate has created the table. New does not touch the database.
// For a pgx pool, use github.com/pgidem/idem/idempgx instead.
func New(db *sql.DB, opts Options) (*Middleware, error) {
	if db == nil {
		return nil, errors.New("idem: New needs a *sql.DB")
	}
	m, err := newMiddleware(sqlPool{db}, opts)
	if err == nil && db.Stats().MaxOpenConnections == 0 {
		// A retry storm opens a connection per concurrent request, past
		// PostgreSQL's max_connections: every request then fails.
		m.logr().LogAttrs(context.Background(), slog.LevelWarn,
			"idem: the *sql.DB has no connection cap; a retry storm can exhaust PostgreSQL's max_connections and fail every request: call db.SetMaxOpenConns (see docs/operations.md#sizing-the-pool)")
	}
	return m, err
}

func init() {
	driver.NewMiddleware = func(pool driver.Pool, opts any) (any, error) {
		return newMiddleware(pool, opts.(Options))
	}
	driver.HandleFromContext = func(ctx context.Context) (any, bool) {
		s, ok := ctx.Value(ctxKey{}).(*reqState)
		if !ok {
			return nil, false
		}
		h := s.handle()
		return h, h != nil
	}
}

type ctxKey struct{}

// reqState is what the middleware puts in the handler's context.
type reqState struct {
	tx  any // the adapter's transaction: *sql.Tx here, pgx.Tx in idempgx
	key Key
	// lease mode: the transaction is begun when the handler first asks,
	// and the lease is extended when it asks (ExtendLease).
	lazy  *lazyTx
	lease *leaseRun
}

// handle returns the request's transaction, beginning it in lease mode;
// nil when it could not be begun.
func (s *reqState) handle() any {
	if s.lazy != nil {
		return s.lazy.handle()
	}
	return s.tx
}

// Tx returns the transaction that holds the claim of the current request
// (or call of Middleware.Do), for the handler's business writes: they
// commit together with the claim and the stored response, or roll back with
// them. The middleware owns the transaction: never call Commit or Rollback
// on it. ok is false outside an idempotent request or Do's fn (a method the
// middleware does not cover, or no middleware at all, or a middleware of
// package idempgx, whose handlers get a pgx.Tx from idempgx.Tx).
func Tx(ctx context.Context) (tx *sql.Tx, ok bool) {
	s, ok := ctx.Value(ctxKey{}).(*reqState)
	if !ok {
		return nil, false
	}
	tx, ok = s.handle().(*sql.Tx)
	return tx, ok
}

// KeyFromContext returns the key of the current idempotent request, or of
// the current call of Middleware.Do.
func KeyFromContext(ctx context.Context) (Key, bool) {
	s, ok := ctx.Value(ctxKey{}).(*reqState)
	if !ok {
		return Key{}, false
	}
	return s.key, true
}

// ExtendLease makes the lease of the key that ctx's handler (or Do's fn)
// runs for last Options.Lease again from now, fenced by the claim's token
// as the answer is: a heartbeat, so that a long job's lease can be sized
// for how soon a crashed original should be taken over rather than for the
// job's longest run. A handler that may run longer than Lease (with
// HandlerTimeout set above it) calls it at intervals well inside Lease. It
// returns an error wrapping ErrLeaseExpired when the lease had run out and
// another delivery took the key over (this run's answer will not be
// stored: stop), ErrUnavailable when the database could not be reached
// within half the lease, and ErrNotLeased outside a lease-mode handler. A
// heartbeat takes a connection of its own beside the handler's transaction:
// size the pool for one more per handler that beats while it holds one.
func ExtendLease(ctx context.Context) error {
	s, ok := ctx.Value(ctxKey{}).(*reqState)
	if !ok || s.lease == nil {
		return ErrNotLeased
	}
	return s.lease.extend(ctx)
}

// Handler wraps next: requests with a covered method are claimed, run inside
// the claim's transaction and answered after commit; duplicates are answered
// from the store. Its signature fits chi's and gorilla/mux's Use and echo's
// WrapMiddleware. It panics, when it wraps next, if the Middleware was built
// without Options.KeyFunc (such a Middleware serves only Do).
func (m *Middleware) Handler(next http.Handler) http.Handler {
	if m.keyFunc == nil {
		panic("idem: Handler needs Options.KeyFunc to read each request's key; this Middleware was built without one and serves only Do")
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !m.covers(r.Method) {
			next.ServeHTTP(w, r)
			return
		}
		m.serve(w, r, next)
	})
}

// covers reports whether the middleware claims requests with method. HTTP
// methods are case-sensitive, but a route registered without a method
// receives `post` as well as `POST`, and runs the same handler: a method
// that differs from a covered one only in case is covered (it fails closed,
// claimed rather than waved through), and the presets scope it as the
// upper-case method, so `post` after `POST` is a replay.
func (m *Middleware) covers(method string) bool {
	for _, c := range m.methods {
		if strings.EqualFold(c, method) {
			return true
		}
	}
	return false
}

// exchange carries one delivery through the middleware, for the answer,
// the log record and the observation: an HTTP request (w, r and next set)
// or a call of Do (call set).
type exchange struct {
	m       *Middleware
	w       http.ResponseWriter // nil for a call of Do
	r       *http.Request       // nil for a call of Do
	next    http.Handler        // the wrapped handler of an HTTP request
	call    *doCall             // a call of Do; nil for an HTTP request
	payload []byte              // the request body, or Do's payload
	start   time.Time
	obs     Observation
	state   reqState    // what the handler's context carries
	body    bodyReader  // the handler's r.Body
	args    driver.Args // the key's claim
	// endDelivery ends PhaseDelivery, after the Observer (Options.OnPhase).
	endDelivery func(error)
	observed    bool // observe was called
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	x := &exchange{m: m, w: w, r: r, next: next, start: time.Now()}
	x.obs.Method, x.obs.Context = r.Method, r.Context()

	buf := getBuffer()
	defer putBuffer(buf) // the handler must not use r.Body after it returns (net/http's rule too)
	body, err := m.readBody(r, buf)
	if err != nil {
		x.fail(OutcomeRejected, problemFor(err))
		return
	}
	key, err := m.keyFunc(r, body)
	if err == nil {
		err = validateKey(key)
	}
	if err != nil {
		x.fail(OutcomeRejected, keyProblem(err))
		return
	}
	x.obs.Key = key
	x.payload = body

	m.deliver(r.Context(), x, key)
}

// deliver carries one delivery of key, whose payload x holds, through the
// engine, whichever way it came in (serve, Do): the replay cache, the
// deliveries of the key on this instance, the claim (or the lease-mode
// claim) with its wait and takeover, then the handler and the COMMIT. Its
// answer goes to x. ctx is the request's context, detached from the client
// once the replay cache has not answered, or the context of Do's caller.
//
// A panic (the database driver's, in the claim or the COMMIT) goes on, and
// the delivery is observed first, and its PhaseDelivery ended, if nothing
// observed it yet (a panicking handler is observed by run or runDo).
func (m *Middleware) deliver(ctx context.Context, x *exchange, key Key) {
	returned := false
	defer func() {
		if !returned && !x.observed {
			x.obs.Outcome, x.obs.Err = OutcomeStoreError, errDeliveryPanicked
			x.observe()
		}
	}()
	m.deliverKey(ctx, x, key)
	returned = true
}

// errDeliveryPanicked is the Observation's error of a delivery that a
// panic outside the handler ended: the database driver's, most likely.
var errDeliveryPanicked = errors.New("idem: a panic outside the handler (in the database driver?) ended the delivery")

// endOnPanic, deferred, ends the phase *end with errDeliveryPanicked if it
// is still open when the function returns: that function panicked before
// it could end it (and set *end to nil).
func endOnPanic(end *func(error)) {
	if *end != nil {
		(*end)(errDeliveryPanicked)
	}
}

// deliverKey is deliver without its care for panics.
func (m *Middleware) deliverKey(ctx context.Context, x *exchange, key Key) {
	digest := sha256.Sum256(x.payload)
	if m.onPhase != nil {
		ctx, x.endDelivery = m.phase(ctx, PhaseDelivery, key)
		x.obs.Context = ctx
	}

	if x.replayCached(key, digest[:], x.start) {
		return
	}
	if x.call == nil {
		// The work is not tied to the client's connection: a client that
		// hangs up mid-handler must not roll back work that its redelivery
		// would then redo. LockWait bounds the waits, HandlerTimeout the
		// handler. (Do's caller decides with the ctx it passes.)
		ctx = context.WithoutCancel(ctx)
	}

	// One delivery of a key at a time on this instance: the others wait in
	// memory, holding no connection, and then usually find the answer in the
	// replay cache.
	var deadline time.Time // LockWait counts from when the key is first found in flight
	for {
		busy := m.flights.enter(key)
		if busy == nil {
			break
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(m.lockWait)
		}
		if !time.Now().Before(deadline) { // LockWait is over (or 0: answer at once)
			x.fail(OutcomeInFlight, problemFor(ErrInFlight))
			return
		}
		waitStart := time.Now()
		waitCtx, endWait := m.phase(ctx, PhaseWait, key)
		done := m.flights.await(waitCtx, busy, deadline)
		x.obs.Wait += time.Since(waitStart)
		if !done {
			err := ErrInFlight
			if ctx.Err() != nil { // Do's caller gave up first
				err = fmt.Errorf("%w: %w", ErrInFlight, context.Cause(ctx))
			}
			endPhase(endWait, err)
			x.fail(OutcomeInFlight, problemFor(err))
			return
		}
		endPhase(endWait, nil)
		if x.replayCached(key, digest[:], time.Now()) {
			return
		}
	}
	defer m.flights.leave(key)

	x.args = driver.Args{Source: key.Source, EventID: key.EventID, Digest: digest[:], Lock: m.table.lockID(key)}
	if m.lease > 0 {
		m.serveLease(ctx, x, key)
		return
	}

	// The claim may first wait (LockWait) for an original on another
	// instance; HandlerTimeout counts from when the key is claimed.
	ctx, cancel := context.WithTimeout(ctx, m.lockWait+m.handlerTimeout)
	defer cancel()
	claimCtx, endClaim := m.phase(ctx, PhaseClaim, key)
	defer endOnPanic(&endClaim)
	c := m.claim(claimCtx, &x.args, deadline)
	endPhase(endClaim, c.problem.cause())
	endClaim = nil
	x.obs.TookOver = c.tookOver
	x.obs.Wait += c.waited
	switch {
	case c.problem != nil:
		x.fail(c.outcome, c.problem)
		return
	case c.replay != nil:
		m.cache.put(key, c.replay, x.start)
		x.replay(c.replay)
		return
	}
	ctx, cancelRun := context.WithTimeout(ctx, m.handlerTimeout)
	defer cancelRun()
	x.handle(ctx, c.tx, reqState{tx: c.tx.Handle(), key: key})
}

// handle runs the delivery's handler on the claimed key: the wrapped
// http.Handler (run) or Do's function (runDo).
func (x *exchange) handle(ctx context.Context, tx finisher, state reqState) {
	if x.call != nil {
		x.m.runDo(ctx, x, tx, state)
		return
	}
	x.m.run(ctx, x, tx, state, x.payload, x.next)
}

// replayCached answers from the replay cache, if it holds the key: the
// stored answer, or 422 for another body. It reports whether it answered.
func (x *exchange) replayCached(key Key, digest []byte, now time.Time) bool {
	s, ok := x.m.cache.get(key, now)
	if !ok {
		return false
	}
	x.obs.Cached = true
	if subtle.ConstantTimeCompare(s.digest, digest) != 1 {
		x.fail(OutcomeMismatch, problemFor(ErrPayloadMismatch))
		return true
	}
	x.replay(s)
	return true
}

// keyProblem answers a KeyFunc or validation error with 400, or 401 for a
// signature that does not verify. Only errors that wrap ErrNoKey,
// ErrInvalidKey, ErrBadBody or ErrSignature have their text shown to the
// caller; a custom KeyFunc's other errors may carry anything.
func keyProblem(err error) *Problem {
	if errors.Is(err, ErrSignature) || errors.Is(err, ErrNoKey) || errors.Is(err, ErrInvalidKey) || errors.Is(err, ErrBadBody) {
		return problemFor(err)
	}
	p := problemFor(fmt.Errorf("%w: %w", ErrInvalidKey, err))
	p.Detail = "The request carries no valid idempotency key."
	return p
}
