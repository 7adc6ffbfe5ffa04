package idem

import (
	"context"
	"log/slog"
	"strconv"
	"time"
)

// Outcome is what became of one request.
type Outcome int

// The outcomes an Observer sees.
const (
	// OutcomeCompleted: the key was claimed, the handler answered a final
	// status, and claim, writes and answer committed together.
	OutcomeCompleted Outcome = iota + 1
	// OutcomeReplayed: a duplicate of a completed key, answered with the
	// stored response.
	OutcomeReplayed
	// OutcomeInFlight: a duplicate whose original was still running (409).
	OutcomeInFlight
	// OutcomeMismatch: the key was completed for a different body (422).
	OutcomeMismatch
	// OutcomeRolledBack: the key was claimed, but the handler answered a
	// status that is not final, panicked, timed out, misused the
	// transaction or wrote too much; nothing was committed (but for a
	// COMMIT still waiting at HandlerTimeout, which may commit later).
	OutcomeRolledBack
	// OutcomeRejected: the request was refused before any claim (400, 401, 413).
	OutcomeRejected
	// OutcomeStoreError: the database failed to begin, claim, store or
	// commit (503); nothing was committed.
	OutcomeStoreError
	// OutcomeConflict: the claim kept failing with serialization failures
	// or deadlocks and was given up (409); nothing was committed. Unlike
	// OutcomeInFlight, no original was seen running.
	OutcomeConflict
	// OutcomeFenced: lease mode; the handler's lease ran out and another
	// delivery took the key over before it finished, so its writes and
	// answer were rolled back (409).
	OutcomeFenced
)

var outcomeNames = [...]string{"", "completed", "replayed", "in_flight", "mismatch", "rolled_back", "rejected", "store_error", "conflict", "fenced"}

// String returns the outcome's name in snake case, for metric labels.
func (o Outcome) String() string {
	if o > 0 && int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// Observation describes one request the middleware handled, or one call
// of Middleware.Do.
type Observation struct {
	Outcome  Outcome
	Key      Key           // zero when the request was rejected before its key was known
	Method   string        // the request method; "" for a call of Middleware.Do
	Status   int           // the status sent to the client; for a call of Do, the status an HTTP delivery would have got (Do's answers are stored as 200), 0 when fn failed or panicked
	Duration time.Duration // from the middleware's start until the answer is ready to send
	Wait     time.Duration // time spent waiting for an in-flight original
	Cached   bool          // replayed from this instance's memory, without the database
	TookOver bool          // the key had a lease-mode claim whose lease ran out (a crashed original), and this request took it over
	Err      error         // the cause, for every outcome but completed and replayed
	// Context is the request's context (r.Context()), or the one Do was
	// called with, so that an observer can reach the active span or the
	// request's values. Once the key is known and Options.OnPhase is set,
	// it is the context OnPhase returned for PhaseDelivery.
	Context context.Context
}

// Observers returns an Observer that hands each Observation to each of
// observers in turn, skipping nil ones: to feed Prometheus and
// OpenTelemetry both, say, as Options.Observer takes one function.
func Observers(observers ...func(Observation)) func(Observation) {
	var all []func(Observation)
	for _, o := range observers {
		if o != nil {
			all = append(all, o)
		}
	}
	return func(o Observation) {
		for _, f := range all {
			f(o)
		}
	}
}

// Phase is one step of a delivery, for Options.OnPhase.
type Phase int

// The phases OnPhase sees, each with its start and its end.
const (
	// PhaseDelivery: the whole delivery, from when its key is known until
	// its answer is ready (the Observer is called just before it ends).
	// The other phases run inside it.
	PhaseDelivery Phase = iota + 1
	// PhaseClaim: beginning the transaction and claiming the key, or
	// finding its stored answer in the database; a wait in PostgreSQL for
	// an original (PhaseWait) runs inside it.
	PhaseClaim
	// PhaseWait: a duplicate waiting for an original of its key in flight,
	// in memory on this instance (before PhaseClaim) or in PostgreSQL
	// (inside PhaseClaim, holding a connection).
	PhaseWait
	// PhaseHandler: the wrapped handler, or Do's fn; the context it gets
	// derives from the one OnPhase returned.
	PhaseHandler
	// PhaseCommit: storing the answer and committing (in lease mode, the
	// fenced completion).
	PhaseCommit
)

// phase starts phase p of the delivery of key, when Options.OnPhase is set,
// and returns the context to run it with and the function that ends it
// (nil when there is nothing to end: pass it to endPhase).
func (m *Middleware) phase(ctx context.Context, p Phase, key Key) (context.Context, func(error)) {
	if m.onPhase == nil {
		return ctx, nil
	}
	c, end := m.onPhase(ctx, p, key)
	if c == nil {
		c = ctx
	}
	return c, end
}

// endPhase ends a phase that phase started.
func endPhase(end func(error), err error) {
	if end != nil {
		end(err)
	}
}

// Stats is what a Middleware holds at one moment, for gauges.
type Stats struct {
	ReplayCacheBytes   int64 // the heap the replay cache holds, as Options.ReplayCacheBytes counts it
	ReplayCacheEntries int   // the answers in the replay cache
	// WaitingInPostgres counts the duplicates waiting in PostgreSQL for an
	// original in flight on another instance, each holding a pooled
	// connection (at most a quarter of the pool's cap).
	WaitingInPostgres int
	// WaitingInMemory counts the duplicates waiting in memory, holding no
	// connection, for a delivery of their key on this instance.
	WaitingInMemory int
}

// Stats returns what m holds now: its replay cache, and the duplicates
// waiting for an original. It is cheap enough for a metrics scrape.
func (m *Middleware) Stats() Stats {
	var s Stats
	if !m.cache.disabled {
		m.cache.mu.Lock()
		s.ReplayCacheBytes, s.ReplayCacheEntries = m.cache.size, len(m.cache.entries)
		m.cache.mu.Unlock()
	}
	m.waiting.mu.Lock()
	s.WaitingInPostgres = m.waiting.used
	m.waiting.mu.Unlock()
	s.WaitingInMemory = int(m.flights.waiters.Load())
	return s
}

func (x *exchange) observe() {
	x.observed = true
	if x.endDelivery != nil {
		end := x.endDelivery
		x.endDelivery = nil
		defer end(x.obs.Err) // after the Observer, even one that panics
	}
	if x.m.observer != nil {
		x.obs.Duration = time.Since(x.start)
		x.m.observer(x.obs)
	}
}

// logr is Options.Logger, or slog.Default() as it is now.
func (m *Middleware) logr() *slog.Logger {
	if m.logger != nil {
		return m.logger
	}
	return slog.Default()
}

func (m *Middleware) log(x *exchange, level slog.Level, msg string, err error) {
	if x.call != nil { // a call of Do: no method, no path
		m.logr().LogAttrs(x.call.ctx, level, "idem: "+msg,
			slog.String("source", x.obs.Key.Source),
			slog.String("event_id", x.obs.Key.EventID),
			slog.String("call", "Do"),
			slog.Any("error", err))
		return
	}
	m.logr().LogAttrs(x.r.Context(), level, "idem: "+msg,
		slog.String("source", x.obs.Key.Source),
		slog.String("event_id", x.obs.Key.EventID),
		slog.String("method", x.r.Method),
		slog.String("path", x.r.URL.Path),
		slog.Any("error", err))
}
