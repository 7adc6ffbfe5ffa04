package idem

import (
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
}

func (x *exchange) observe() {
	if x.m.observer == nil {
		return
	}
	x.obs.Duration = time.Since(x.start)
	x.m.observer(x.obs)
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
