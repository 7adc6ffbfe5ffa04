package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/pgidem/idem/internal/claims"
	"github.com/pgidem/idem/internal/driver"
)

// Defaults for the zero values of Options.
const (
	DefaultLockWait         = 2 * time.Second
	DefaultMaxBodyBytes     = 1 << 20 // 1 MiB
	DefaultMaxResponseBytes = 1 << 20 // 1 MiB
	DefaultRetryAfter       = time.Second
	DefaultHandlerTimeout   = 30 * time.Second
	DefaultReplayCacheBytes = 16 << 20 // 16 MiB
	DefaultReplayCacheTTL   = time.Minute
)

// DefaultReplayHeaders returns the response headers stored and replayed
// when Options.ReplayHeaders is nil, in a new slice each time (append your
// own to it). Content-Type is always replayed. They are the headers that
// describe the answer, and those that tell the client how to treat it
// safely (no sniffing, the content policy, framing, referrers, HTTPS only,
// cross-origin isolation): a replay without them would be a weaker answer
// than the original.
func DefaultReplayHeaders() []string { return append([]string(nil), defaultReplayHeaders...) }

// defaultReplayHeaders are DefaultReplayHeaders, read by New.
var defaultReplayHeaders = []string{
	"Content-Type", "Content-Encoding", "Content-Language", "Content-Location",
	"Location", "ETag", "Last-Modified", "Cache-Control", "Link", "Vary",
	"X-Content-Type-Options", "Content-Security-Policy", "Content-Security-Policy-Report-Only",
	"X-Frame-Options", "Referrer-Policy", "Strict-Transport-Security", "Permissions-Policy",
	"Cross-Origin-Opener-Policy", "Cross-Origin-Embedder-Policy", "Cross-Origin-Resource-Policy",
}

// neverReplayed are the headers New refuses in ReplayHeaders, and why:
// those that carry credentials or session state, the hop-by-hop headers
// of one connection (RFC 9110 §7.6.1, and the legacy ones proxies still
// send), and those the middleware writes itself.
var neverReplayed = map[string]string{
	"Set-Cookie": "credentials", "Set-Cookie2": "credentials", "Cookie": "credentials",
	"Authorization": "credentials", "Proxy-Authorization": "credentials",
	"Www-Authenticate": "credentials", "Proxy-Authenticate": "credentials",
	"Connection": "hop-by-hop", "Keep-Alive": "hop-by-hop", "Proxy-Connection": "hop-by-hop",
	"Te": "hop-by-hop", "Trailer": "hop-by-hop", "Transfer-Encoding": "hop-by-hop", "Upgrade": "hop-by-hop",
	"Content-Length": "written by the middleware", "Idempotent-Replayed": "written by the middleware",
}

// Options configures a Middleware. The zero value of every field means its
// documented default; KeyFunc has none.
type Options struct {
	// KeyFunc extracts the key of a request. Required by Handler, which
	// panics without it. A Middleware built without one serves only Do,
	// whose caller passes each key itself (a queue consumer has no request
	// to read a key from).
	KeyFunc KeyFunc

	// Table is the idempotency table, "" for DefaultTable. It may be
	// schema-qualified ("billing.webhook_keys"). The table and its schema
	// must each be 1 to 63 characters of a-z, 0-9 and _, not starting with
	// a digit (a name PostgreSQL reads the same quoted or unquoted): New
	// refuses any other name, as Migrate and package idemops do.
	Table string

	// LockWait is the longest a duplicate waits for an in-flight original to
	// finish before it is answered 409 with Retry-After: 0 means
	// DefaultLockWait (2s); a negative value answers 409 at once. Keep it
	// under the sender's timeout. Duplicates of an original running on this
	// instance wait in memory; for an original on another instance, one
	// duplicate per key waits in PostgreSQL, holding a pooled connection,
	// and at most a quarter of the pool's cap waits there at once.
	LockWait time.Duration

	// Methods are the request methods the middleware makes idempotent; other
	// methods (GET, HEAD, OPTIONS, ...) go straight to the handler, without a
	// transaction. nil means POST, PUT, PATCH and DELETE. They are matched
	// without regard to case: a route registered without a method runs its
	// handler for `post` too, so `post` is claimed as POST (and a preset
	// scopes it as POST).
	Methods []string

	// MaxBodyBytes bounds the request body, which is read in full before the
	// key is extracted; larger bodies get 413. The buffer grows as the
	// bytes arrive, from at most 32 KiB, whatever Content-Length announces.
	// 0 means DefaultMaxBodyBytes (1 MiB).
	MaxBodyBytes int64

	// MaxResponseBytes bounds the buffered response: its body, plus, for
	// an answer to be stored, the replayed headers as stored (a JSON
	// object). A handler whose answer is larger is rolled back and answered
	// 500. 0 means DefaultMaxResponseBytes (1 MiB).
	MaxResponseBytes int64

	// FinalStatus reports whether a handler's status is final: stored,
	// committed with the handler's writes, and replayed to every duplicate.
	// Any other status rolls back the claim and the handler's writes, so a
	// redelivery runs the handler again. nil means 2xx only. An answer in
	// the gRPC, gRPC-Web or Connect streaming protocol (Content-Type
	// application/grpc..., application/connect+...), which is 200 whatever
	// its outcome, is final only if it also says success: grpc-status 0, or
	// an end-of-stream message without an error (see docs/grpc.md).
	FinalStatus func(status int) bool

	// ReplayHeaders are the response headers stored and replayed, besides
	// Content-Type. nil means DefaultReplayHeaders(). Set-Cookie, credentials
	// and hop-by-hop headers are refused by New.
	ReplayHeaders []string

	// RetryAfter is sent as Retry-After (whole seconds, at least 1) with
	// 409 and 503 answers. 0 means DefaultRetryAfter (1s). In lease mode a
	// duplicate of a key whose lease still runs gets the lease's time left
	// instead, rounded up to whole seconds, at least RetryAfter and at most
	// a minute (or RetryAfter, if that is longer): the original may be alive
	// and finish sooner, and the retry then gets its answer.
	RetryAfter time.Duration

	// HandlerTimeout bounds the handler, storing its answer and the commit,
	// from when the key is claimed (a wait for an original before that is
	// bounded by LockWait). The handler's request context is detached from
	// the client's connection (a client that hangs up does not cancel the
	// work, so its redelivery gets the replay) and carries this deadline
	// instead; when it passes, the transaction is rolled back and the answer
	// is 503. A COMMIT already sent is never cancelled (a cancelled wait for
	// a synchronous standby commits anyway, unreplicated): the answer is 503
	// and the COMMIT goes on, its key answering 409 until it ends (see
	// docs/durability.md). For Do, it bounds fn and the commit in the same
	// way, and the caller's ctx can end them sooner. 0 means
	// DefaultHandlerTimeout (30s).
	HandlerTimeout time.Duration

	// Lease > 0 turns on lease mode, for handlers that make slow calls to
	// other services: the claim commits at once as an in-progress row
	// whose lease ends after Lease, no connection is held while the
	// handler runs, and the transaction of Tx is begun when the handler
	// first asks for it; it commits together with the stored answer, only
	// if the claim still owns the key (else it rolls back and the answer
	// is 409). A duplicate while the lease lasts gets 409, with
	// Retry-After the lease's time left (see RetryAfter); once it has run
	// out (the original crashed), the next delivery takes the key over. A
	// status that is not final, a panic or HandlerTimeout releases the key
	// when the handler returns. Handlers must honour their context's
	// deadline. HandlerTimeout, when not set, is four fifths of Lease (or
	// 30s, if that is less); set above Lease, it is for handlers that keep
	// their lease with ExtendLease: one that does not may be taken over
	// while it runs (its answer is then not stored, ErrLeaseExpired). 0 (the
	// default) is single-transaction mode: claim, writes and answer in one
	// transaction.
	Lease time.Duration

	// TxOptions are passed to BeginTx for the claim transaction. nil means
	// the database default, normally READ COMMITTED, which the claim is
	// designed for. Under REPEATABLE READ or SERIALIZABLE, serialization
	// failures are retried a bounded number of times.
	TxOptions *sql.TxOptions

	// Logger receives one record per failed or refused request and every
	// misuse, with source and event id, never bodies, and New's warnings.
	// nil means slog.Default(); to silence it, pass
	// slog.New(slog.DiscardHandler).
	Logger *slog.Logger

	// ErrorHandler renders the middleware's own error answers. nil means
	// WriteProblem (application/problem+json). Retry-After is already set
	// on w when the answer invites a retry.
	ErrorHandler func(w http.ResponseWriter, r *http.Request, p *Problem)

	// ReplayCacheBytes bounds an in-memory cache of replayed answers: once
	// this instance has replayed a key's answer from the database, further
	// duplicates of it are served without a round trip (the body digest is
	// still checked). Only keys that have had a duplicate are kept, so the
	// great majority of events, which never do, cost the cache nothing.
	// Duplicates of keys this instance has not replayed always go to the
	// database. The bound is on the heap the cache holds, keys, answers and
	// bookkeeping counted as allocated (a small JSON answer costs about 900
	// bytes). 0 means DefaultReplayCacheBytes (16 MiB); a negative value
	// turns the cache off.
	ReplayCacheBytes int64

	// ReplayCacheTTL is how long a cached answer is served from memory. A
	// key's row can only change by being deleted (by the retention sweep, or
	// by hand to have an event processed again); after this long, every
	// instance sees the deletion. 0 means DefaultReplayCacheTTL (1 minute).
	ReplayCacheTTL time.Duration

	// Observer, if set, is called once per request the middleware handles
	// (and per call of Do, with an empty Observation.Method),
	// with its outcome and timings, just before the answer is written (so a
	// client that has its answer can rely on the observation existing; after
	// a panic, when the handler returns). It runs on the request's
	// goroutine: keep it fast (count, don't block).
	Observer func(Observation)

	// OnPhase, if set, is called at the start of each phase of a delivery
	// (PhaseDelivery, PhaseClaim, PhaseWait, PhaseHandler, PhaseCommit)
	// with the context the phase would run with, and the key; the context
	// it returns is the one the phase runs with (its SQL statements, the
	// handler), and the function it returns, if not nil, is called once
	// when the phase ends, with the error it failed with, if any: idem's
	// own errors (PhaseHandler ends with nil for an HTTP handler, whatever
	// it answered; with fn's error for Do). It is for tracing (package
	// idemotel starts a span per phase, so that the SQL spans of a traced
	// driver nest under them). The context it returns must derive from
	// ctx: it carries HandlerTimeout's deadline and idem's state. A COMMIT
	// still running at HandlerTimeout goes on, but PhaseCommit ends then,
	// with ErrHandlerTimeout; the COMMIT's outcome is only logged. Phases
	// start and end on the request's goroutine; keep it fast. nil costs
	// nothing.
	OnPhase func(ctx context.Context, p Phase, key Key) (context.Context, func(err error))
}

// newMiddleware validates opts and builds the engine, which claims keys
// through pool.
func newMiddleware(pool driver.Pool, opts Options) (*Middleware, error) {
	t, err := parseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	store, err := claims.New(pool, driver.NewQueries(t.Quoted), opts.TxOptions)
	if err != nil {
		return nil, err
	}
	m := &Middleware{
		drv:            store,
		table:          t,
		keyFunc:        opts.KeyFunc,
		lockWait:       opts.LockWait,
		maxBody:        opts.MaxBodyBytes,
		finalStatus:    opts.FinalStatus,
		handlerTimeout: opts.HandlerTimeout,
		logger:         opts.Logger,
		errorHandler:   opts.ErrorHandler,
		observer:       opts.Observer,
		onPhase:        opts.OnPhase,
	}
	switch {
	case opts.LockWait == 0:
		m.lockWait = DefaultLockWait
	case opts.LockWait < 0:
		m.lockWait = 0
	}
	store.LockWait = m.lockWait
	switch {
	case opts.MaxBodyBytes == 0:
		m.maxBody = DefaultMaxBodyBytes
	case opts.MaxBodyBytes < 0:
		return nil, errors.New("idem: Options.MaxBodyBytes must not be negative")
	}
	switch {
	case opts.MaxResponseBytes == 0:
		m.maxResponse = DefaultMaxResponseBytes
	case opts.MaxResponseBytes < 0 || opts.MaxResponseBytes > 1<<30:
		return nil, errors.New("idem: Options.MaxResponseBytes must be between 0 and 1 GiB")
	default:
		m.maxResponse = int(opts.MaxResponseBytes)
	}
	switch {
	case opts.HandlerTimeout == 0:
		m.handlerTimeout = DefaultHandlerTimeout
		if opts.Lease > 0 {
			m.handlerTimeout = min(DefaultHandlerTimeout, opts.Lease*4/5)
		}
	case opts.HandlerTimeout < 0:
		return nil, errors.New("idem: Options.HandlerTimeout must not be negative")
	}
	switch {
	case opts.Lease < 0:
		return nil, errors.New("idem: Options.Lease must not be negative")
	case opts.Lease > 0 && opts.Lease < time.Millisecond:
		return nil, errors.New("idem: Options.Lease must be at least a millisecond")
	}
	m.lease = opts.Lease
	retry := opts.RetryAfter
	switch {
	case retry == 0:
		retry = DefaultRetryAfter
	case retry < 0:
		return nil, errors.New("idem: Options.RetryAfter must not be negative")
	}
	ttl := opts.ReplayCacheTTL
	switch {
	case ttl == 0:
		ttl = DefaultReplayCacheTTL
	case ttl < 0:
		return nil, errors.New("idem: Options.ReplayCacheTTL must not be negative")
	}
	cacheBytes := opts.ReplayCacheBytes
	if cacheBytes == 0 {
		cacheBytes = DefaultReplayCacheBytes
	}
	m.cache = newReplayCache(cacheBytes, ttl)
	m.retryAfter, m.retryAfterMin = seconds(retry), retry
	if m.finalStatus == nil {
		m.finalStatus = func(s int) bool { return s >= 200 && s < 300 }
	}
	if m.errorHandler == nil {
		m.errorHandler = WriteProblem
	}
	methods := opts.Methods
	if methods == nil {
		methods = []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}
	}
	for _, meth := range methods {
		if meth == "" {
			return nil, errors.New("idem: Options.Methods has an empty method")
		}
		m.methods = append(m.methods, strings.ToUpper(meth))
	}
	headers := opts.ReplayHeaders
	if headers == nil {
		headers = defaultReplayHeaders
	}
	m.replayHeaders = []string{"Content-Type"}
	for _, h := range headers {
		c := http.CanonicalHeaderKey(h)
		if why, ok := neverReplayed[c]; ok {
			return nil, fmt.Errorf("idem: Options.ReplayHeaders: %s is never replayed (%s)", c, why)
		}
		if c != "Content-Type" && c != "" {
			m.replayHeaders = append(m.replayHeaders, c)
		}
	}
	if m.lease > 0 && m.handlerTimeout >= m.lease {
		m.logr().LogAttrs(context.Background(), slog.LevelWarn,
			"idem: Options.HandlerTimeout is not shorter than Options.Lease: a handler that runs past its lease without idem.ExtendLease can be taken over while it runs, and what it does outside the database then happens twice (see docs/lease.md)",
			slog.Duration("handler_timeout", m.handlerTimeout), slog.Duration("lease", m.lease))
	}
	return m, nil
}
