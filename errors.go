package idem

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"
)

// Errors the middleware reports, through Problem.Err, Observation.Err and
// its logs, and that Do returns. Each has its own HTTP answer; match them
// with errors.Is. For a caller of Do, each says whether fn ran and whether
// its effect (its writes through Tx, and Value) may have committed. Whatever
// the error, a redelivery of the same key and payload is safe: a key whose
// effect committed is replayed, never run again. Retryable says whether a
// redelivery is worth making.
var (
	// ErrNoKey: the request carries no idempotency key (400). KeyFuncs wrap it.
	ErrNoKey = errors.New("idem: no idempotency key")
	// ErrInvalidKey: the key is malformed, too long, or not valid text (400).
	// KeyFuncs wrap it. Do returns it for a key with an empty, too long (over
	// MaxKeyLen bytes) or invalid (not UTF-8, control characters) part: fn
	// did not run, nothing was written, and a redelivery fails alike.
	ErrInvalidKey = errors.New("idem: invalid idempotency key")
	// ErrBadBody: the key is read from the request body, which is missing
	// or is not the JSON the KeyFunc expects (400). KeyFuncs wrap it.
	ErrBadBody = errors.New("idem: missing or malformed request body")
	// ErrSignature: the request's webhook signature is missing, malformed,
	// made with none of the endpoint's secrets, or made too long ago (401).
	// The verifying presets wrap it; a custom KeyFunc that checks a
	// signature can too.
	ErrSignature = errors.New("idem: webhook signature does not verify")
	// ErrBodyTooLarge: the request body, or Do's payload, is over
	// Options.MaxBodyBytes (413). fn did not run; nothing was written.
	ErrBodyTooLarge = errors.New("idem: request body too large")
	// ErrBodyUnreadable: reading the request body failed (400).
	ErrBodyUnreadable = errors.New("idem: request body could not be read")
	// ErrInFlight: an earlier delivery of the key is still running and did not
	// finish within Options.LockWait, or holds a live lease (409 with
	// Retry-After). fn did not run. A later retry gets the original's
	// answer, or runs fn if the original failed. It also names a key whose
	// row was committed without an answer (a handler that ended the
	// transaction itself): that key needs an operator (docs/operations.md).
	ErrInFlight = errors.New("idem: an earlier request with this key is still in progress")
	// ErrConflict: the claim kept failing with serialization failures or
	// deadlocks and was given up after a bounded number of tries (409). fn
	// did not run; nothing was committed.
	ErrConflict = errors.New("idem: the claim kept failing with serialization failures or deadlocks")
	// ErrLeaseExpired: lease mode; the handler's lease ran out and another
	// delivery took the key over, so this run's writes and answer were
	// rolled back (409 with Retry-After; the retry gets the answer stored
	// by the delivery that took over, or 409 while it still runs). For Do:
	// fn ran, but its writes through Tx and its Value rolled back; what fn
	// did outside the transaction (a call to another service) did happen.
	ErrLeaseExpired = errors.New("idem: the lease ran out and another delivery took the key over")
	// ErrNotLeased: ExtendLease was called outside a lease-mode handler
	// (no Options.Lease, or not from the handler's or fn's context).
	ErrNotLeased = errors.New("idem: ExtendLease needs the context of a lease-mode handler")
	// ErrPayloadMismatch: the key was completed for a different request body,
	// or Do's payload (422). fn did not run, and a redelivery fails alike:
	// the key was reused for another event.
	ErrPayloadMismatch = errors.New("idem: key reused with a different request body")
	// ErrUnavailable: the database could not begin, claim, store or commit
	// (503 with Retry-After). Nothing was committed, except when idempgx
	// reports a COMMIT that PostgreSQL answered with a WARNING (see
	// idempgx.DetectUnreplicatedCommits), or when the connection broke while
	// the COMMIT was under way: its outcome is unknown, and fn's effect may
	// have committed. A redelivery then finds out: it is replayed if so.
	ErrUnavailable = errors.New("idem: idempotency store unavailable")
	// ErrHandlerTimeout: the handler (or Do's fn) outlived
	// Options.HandlerTimeout, or Do's ctx ended, and its transaction was
	// rolled back (503 with Retry-After), or its COMMIT had not answered by
	// then (waiting for a synchronous standby): that COMMIT goes on and may
	// still commit, so fn's effect may have committed.
	ErrHandlerTimeout = errors.New("idem: handler timed out")
	// ErrTxMisuse: the handler (or Do's fn) committed or rolled back the
	// transaction that belongs to the middleware (500). On database/sql a
	// Commit of fn's did commit its writes and the key, without an answer:
	// the key's next deliveries get ErrInFlight until an operator settles it.
	// A programming error: a redelivery does not help.
	ErrTxMisuse = errors.New("idem: the handler ended the middleware's transaction")
	// ErrTxAborted: a statement of the handler failed, which aborts the
	// transaction, yet the handler answered a final status (or Do's fn
	// returned no error): the answer cannot be stored, so everything is
	// rolled back (500). Answer an error status (return an error) when a
	// write fails. A redelivery may pass if the statement failed for a
	// passing reason (a deadlock, a serialization failure).
	ErrTxAborted = errors.New("idem: the handler answered a final status after one of its statements failed")
	// ErrResponseTooLarge: the handler's response, or Do's Value, is over
	// Options.MaxResponseBytes and cannot be stored; rolled back (500).
	ErrResponseTooLarge = errors.New("idem: response too large to store")
	// ErrWriteAfterReturn: something wrote to the handler's ResponseWriter
	// after the handler returned, when the answer was already decided and
	// sent. With echo, this is a handler's returned error rendered by
	// echo.WrapMiddleware: render errors inside the wrapped chain instead.
	ErrWriteAfterReturn = errors.New("idem: write after the handler returned; the answer was already sent")
	// ErrHijack: the handler tried to hijack the connection, which cannot be
	// made idempotent.
	ErrHijack = errors.New("idem: hijacking is not supported under the idempotency middleware")
)

// Problem is an error answer of the middleware, rendered by
// Options.ErrorHandler. The default renderer writes an RFC 9457
// application/problem+json document with Type, Title, Status and Detail;
// Err is there for logs and custom renderers and is never sent by default.
type Problem struct {
	Status int    // HTTP status: 400, 401, 409, 413, 422, 500 or 503; never 410
	Type   string // a URI naming the kind of problem
	Title  string // a short, fixed summary of the kind
	Detail string // safe for the caller: never SQL or internal error text
	Key    Key    // the request's key, when it was extracted
	Err    error  // the cause; wraps one of the Err* values above

	leaseLeft time.Duration // for a duplicate of a lease-mode original: its lease's time left
}

// cause is p.Err, or nil for no problem.
func (p *Problem) cause() error {
	if p == nil {
		return nil
	}
	return p.Err
}

// Problem type URIs, one per kind of answer.
const problemBase = "https://github.com/pgidem/idem/blob/main/docs/problems.md#"

// WriteProblem is the default Options.ErrorHandler: it writes p as a small
// application/problem+json document. Any Retry-After header the middleware
// set is already on w.
func WriteProblem(w http.ResponseWriter, _ *http.Request, p *Problem) {
	doc := struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail,omitempty"`
	}{p.Type, p.Title, p.Status, p.Detail}
	b, _ := json.Marshal(doc) // cannot fail: strings and an int
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(p.Status)
	_, _ = w.Write(b)
}

// problemFor maps an error of the middleware to its answer. Details are
// fixed strings, or the KeyFunc's own message when it wraps ErrNoKey,
// ErrInvalidKey, ErrBadBody or ErrSignature (our KeyFuncs write those for
// the caller).
func problemFor(err error) *Problem {
	p := &Problem{Err: err}
	switch {
	case errors.Is(err, ErrBodyTooLarge):
		p.Status, p.Type, p.Title = http.StatusRequestEntityTooLarge, "body-too-large", "Request body too large"
		p.Detail = "The request body is larger than this endpoint accepts."
	case errors.Is(err, ErrSignature):
		p.Status, p.Type, p.Title = http.StatusUnauthorized, "invalid-signature", "Invalid webhook signature"
		p.Detail = trimPrefix(err.Error())
	case errors.Is(err, ErrNoKey), errors.Is(err, ErrInvalidKey):
		p.Status, p.Type, p.Title = http.StatusBadRequest, "invalid-key", "Missing or invalid idempotency key"
		p.Detail = trimPrefix(err.Error())
	case errors.Is(err, ErrBadBody):
		p.Status, p.Type, p.Title = http.StatusBadRequest, "invalid-body", "Missing or malformed request body"
		p.Detail = trimPrefix(err.Error())
	case errors.Is(err, ErrBodyUnreadable):
		p.Status, p.Type, p.Title = http.StatusBadRequest, "body-unreadable", "Request body could not be read"
	case errors.Is(err, ErrPayloadMismatch):
		p.Status, p.Type, p.Title = http.StatusUnprocessableEntity, "payload-mismatch", "Idempotency key reused with a different body"
		p.Detail = "This key was already used for a request with a different body."
	case errors.Is(err, ErrInFlight):
		p.Status, p.Type, p.Title = http.StatusConflict, "in-flight", "Request in progress"
		p.Detail = "An earlier request with this key is still being processed; retry later."
	case errors.Is(err, ErrLeaseExpired):
		p.Status, p.Type, p.Title = http.StatusConflict, "lease-expired", "Lease expired"
		p.Detail = "Processing took longer than this key's lease, and a later request with the same key took over; retry later."
	case errors.Is(err, ErrConflict):
		p.Status, p.Type, p.Title = http.StatusConflict, "conflict", "Serialization failure or deadlock"
		p.Detail = "Claiming the key kept failing with database serialization failures or deadlocks; retry later."
	case errors.Is(err, ErrHandlerTimeout):
		p.Status, p.Type, p.Title = http.StatusServiceUnavailable, "timeout", "Processing timed out"
		p.Detail = "Processing took too long and was rolled back; retry later."
	case errors.Is(err, ErrTxMisuse), errors.Is(err, ErrTxAborted):
		p.Status, p.Type, p.Title = http.StatusInternalServerError, "internal", "Internal error"
	case errors.Is(err, ErrResponseTooLarge):
		p.Status, p.Type, p.Title = http.StatusInternalServerError, "internal", "Internal error"
	default: // ErrUnavailable and anything unexpected
		p.Status, p.Type, p.Title = http.StatusServiceUnavailable, "unavailable", "Service temporarily unavailable"
		p.Detail = "The request was not processed; retry later."
	}
	p.Type = problemBase + p.Type
	return p
}

// retryable reports whether the answer invites the sender to retry later,
// so it carries Retry-After.
func (p *Problem) retryable() bool {
	return p.Status == http.StatusConflict || p.Status == http.StatusServiceUnavailable
}

func trimPrefix(s string) string {
	const prefix = "idem: "
	if len(s) > len(prefix) && s[:len(prefix)] == prefix {
		return s[len(prefix):]
	}
	return s
}
