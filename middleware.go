package idem

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

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

// maxClaimAttempts bounds how often one request begins a claim transaction:
// only serialization failures and deadlocks (REPEATABLE READ, SERIALIZABLE,
// or the handler's own locks in another transaction) make it try again.
const maxClaimAttempts = 4

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

// Options configures a Middleware. The zero value of every field but KeyFunc
// means its documented default.
type Options struct {
	// KeyFunc extracts the key of a request. Required.
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
	// redelivery runs the handler again. nil means 2xx only.
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
	// docs/durability.md). 0 means DefaultHandlerTimeout (30s).
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
	// when the handler returns. HandlerTimeout must be shorter than Lease,
	// and handlers must honour their context's deadline; when it is not
	// set, it is four fifths of Lease (or 30s, if that is less). 0 (the
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

	// Observer, if set, is called once per request the middleware handles,
	// with its outcome and timings, just before the answer is written (so a
	// client that has its answer can rely on the observation existing; after
	// a panic, when the handler returns). It runs on the request's
	// goroutine: keep it fast (count, don't block).
	Observer func(Observation)
}

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

// Observation describes one request the middleware handled.
type Observation struct {
	Outcome  Outcome
	Key      Key           // zero when the request was rejected before its key was known
	Method   string        // the request method
	Status   int           // the status sent to the client
	Duration time.Duration // from the middleware's start until the answer is ready to send
	Wait     time.Duration // time spent waiting for an in-flight original
	Cached   bool          // replayed from this instance's memory, without the database
	TookOver bool          // the key had a lease-mode claim whose lease ran out (a crashed original), and this request took it over
	Err      error         // the cause, for every outcome but completed and replayed
}

// Middleware makes handlers idempotent; build it with New and wrap handlers
// with its Handler method. It is safe for concurrent use.
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
	m, err := newMiddleware(func(q driver.Queries) driver.Driver {
		return &sqlDriver{db: db, q: q, opts: opts.TxOptions}
	}, opts)
	if err == nil && db.Stats().MaxOpenConnections == 0 {
		// A retry storm opens a connection per concurrent request, past
		// PostgreSQL's max_connections: every request then fails.
		m.logr().LogAttrs(context.Background(), slog.LevelWarn,
			"idem: the *sql.DB has no connection cap; a retry storm can exhaust PostgreSQL's max_connections and fail every request: call db.SetMaxOpenConns (see docs/operations.md#sizing-the-pool)")
	}
	return m, err
}

func init() {
	driver.NewMiddleware = func(newDriver func(driver.Queries) driver.Driver, opts any) (any, error) {
		return newMiddleware(newDriver, opts.(Options))
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

// newMiddleware validates opts and builds the engine on the driver that
// newDriver makes for the table's queries.
func newMiddleware(newDriver func(driver.Queries) driver.Driver, opts Options) (*Middleware, error) {
	if opts.KeyFunc == nil {
		return nil, errors.New("idem: Options.KeyFunc is required")
	}
	t, err := parseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	m := &Middleware{
		drv:            newDriver(driver.NewQueries(t.Quoted)),
		table:          t,
		keyFunc:        opts.KeyFunc,
		lockWait:       opts.LockWait,
		maxBody:        opts.MaxBodyBytes,
		finalStatus:    opts.FinalStatus,
		handlerTimeout: opts.HandlerTimeout,
		logger:         opts.Logger,
		errorHandler:   opts.ErrorHandler,
		observer:       opts.Observer,
	}
	switch {
	case opts.LockWait == 0:
		m.lockWait = DefaultLockWait
	case opts.LockWait < 0:
		m.lockWait = 0
	}
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
	case opts.Lease > 0 && m.handlerTimeout >= opts.Lease:
		return nil, fmt.Errorf("idem: Options.HandlerTimeout (%v) must be shorter than Options.Lease (%v): a live original must not outlive its lease", m.handlerTimeout, opts.Lease)
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
	return m, nil
}

type ctxKey struct{}

// reqState is what the middleware puts in the handler's context.
type reqState struct {
	tx  any // the adapter's transaction: *sql.Tx here, pgx.Tx in idempgx
	key Key
	// lease mode: the transaction is begun when the handler first asks.
	lazy *lazyTx
}

// handle returns the request's transaction, beginning it in lease mode;
// nil when it could not be begun.
func (s *reqState) handle() any {
	if s.lazy != nil {
		return s.lazy.handle()
	}
	return s.tx
}

// Tx returns the transaction that holds the claim of the current request,
// for the handler's business writes: they commit together with the claim and
// the stored response, or roll back with them. The middleware owns the
// transaction: never call Commit or Rollback on it. ok is false outside an
// idempotent request (a method the middleware does not cover, or no
// middleware at all, or a middleware of package idempgx, whose handlers
// get a pgx.Tx from idempgx.Tx).
func Tx(ctx context.Context) (tx *sql.Tx, ok bool) {
	s, ok := ctx.Value(ctxKey{}).(*reqState)
	if !ok {
		return nil, false
	}
	tx, ok = s.handle().(*sql.Tx)
	return tx, ok
}

// KeyFromContext returns the key of the current idempotent request.
func KeyFromContext(ctx context.Context) (Key, bool) {
	s, ok := ctx.Value(ctxKey{}).(*reqState)
	if !ok {
		return Key{}, false
	}
	return s.key, true
}

// Handler wraps next: requests with a covered method are claimed, run inside
// the claim's transaction and answered after commit; duplicates are answered
// from the store. Its signature fits chi's and gorilla/mux's Use and echo's
// WrapMiddleware.
func (m *Middleware) Handler(next http.Handler) http.Handler {
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

// exchange carries one request through the middleware, for the answer, the
// log record and the observation.
type exchange struct {
	m     *Middleware
	w     http.ResponseWriter
	r     *http.Request
	start time.Time
	obs   Observation
	state reqState    // what the handler's context carries
	body  bodyReader  // the handler's r.Body
	args  driver.Args // the key's claim
}

// bodyReader replays the buffered request body to the handler.
type bodyReader struct{ bytes.Reader }

// Close does nothing: the middleware owns the buffer.
func (*bodyReader) Close() error { return nil }

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	x := &exchange{m: m, w: w, r: r, start: time.Now()}
	x.obs.Method = r.Method

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
	digest := sha256.Sum256(body)

	if x.replayCached(key, digest[:], x.start) {
		return
	}

	// The work is not tied to the client's connection: a client that hangs
	// up mid-handler must not roll back work that its redelivery would then
	// redo. LockWait bounds the waits, HandlerTimeout the handler.
	ctx := context.WithoutCancel(r.Context())

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
		done := m.flights.await(busy, deadline)
		x.obs.Wait += time.Since(waitStart)
		if !done {
			x.fail(OutcomeInFlight, problemFor(ErrInFlight))
			return
		}
		if x.replayCached(key, digest[:], time.Now()) {
			return
		}
	}
	defer m.flights.leave(key)

	x.args = driver.Args{Source: key.Source, EventID: key.EventID, Digest: digest[:], Lock: m.table.lockID(key)}
	if m.lease > 0 {
		m.serveLease(ctx, x, key, body, next)
		return
	}

	// The claim may first wait (LockWait) for an original on another
	// instance; HandlerTimeout counts from when the key is claimed.
	ctx, cancel := context.WithTimeout(ctx, m.lockWait+m.handlerTimeout)
	defer cancel()
	c := m.claim(ctx, &x.args, deadline)
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
	m.run(ctx, x, c.tx, reqState{tx: c.tx.Handle(), key: key}, body, next)
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

// initialBodyBuffer bounds the buffer a request body starts with, whatever
// its Content-Length announces: connections that announce large bodies and
// stall commit no more memory than this each.
const initialBodyBuffer = 32 << 10

// readBody reads the whole request body, bounded by MaxBodyBytes.
func (m *Middleware) readBody(r *http.Request, buf *bytes.Buffer) ([]byte, error) {
	if r.ContentLength > m.maxBody {
		return nil, ErrBodyTooLarge
	}
	if r.Body == nil || r.Body == http.NoBody {
		return []byte{}, nil
	}
	if r.ContentLength > 0 {
		// Content-Length is the client's word, not bytes received: a
		// bounded start, then the buffer grows as the bytes arrive (room
		// for the read that finds EOF saves a copy of small bodies).
		buf.Grow(int(min(r.ContentLength+bytes.MinRead, initialBodyBuffer)))
	}
	n, err := buf.ReadFrom(&limitedReader{r: r.Body, n: m.maxBody + 1})
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, ErrBodyTooLarge
		}
		return nil, fmt.Errorf("%w: %w", ErrBodyUnreadable, err)
	}
	if n > m.maxBody {
		return nil, ErrBodyTooLarge
	}
	return buf.Bytes(), nil
}

// limitedReader is io.LimitedReader without its allocation per request.
type limitedReader struct {
	r io.Reader
	n int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
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
			if retryable(err) {
				lastErr = err
				continue
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
func (m *Middleware) waitForOriginal(ctx context.Context, tx driver.Tx, a *driver.Args, deadline *time.Time, waited *time.Duration) (driver.Begun, error) {
	if deadline.IsZero() {
		*deadline = time.Now().Add(m.lockWait)
	}
	start := time.Now()
	defer func() { *waited += time.Since(start) }()
	if time.Until(*deadline) <= 0 {
		return driver.Begun{Tx: tx}, errWaitOver
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
		res.problem.retryAfter = m.leaseRetryAfter(row.LeaseLeft)
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
	defer func() {
		if !finished { // the handler panicked: the panic goes on, nothing is sent
			_ = tx.Rollback(ctx)
			x.obs.Outcome, x.obs.Err = OutcomeRolledBack, errors.New("idem: handler panicked")
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
	r2 := x.r.WithContext(context.WithValue(ctx, ctxKey{}, &x.state))
	x.body.Reset(body)
	r2.Body = &x.body
	r2.ContentLength = int64(len(body))
	next.ServeHTTP(rec, r2)
	finished = true

	status := rec.finalStatus()
	final := m.finalStatus(status)
	var headers []byte // the stored headers are part of the answer's size
	if final {
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
		if err := tx.Rollback(ctx); err != nil && ctx.Err() == nil {
			m.log(x, slog.LevelWarn, "rollback failed", err)
		}
		x.obs.Outcome, x.obs.Err = OutcomeRolledBack, fmt.Errorf("idem: handler answered %d, not a final status", status)
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
func (m *Middleware) commit(ctx context.Context, x *exchange, tx finisher, status int, headers, answer []byte) error {
	if err := ctx.Err(); err != nil { // the handler returned past its deadline
		_ = tx.Rollback(ctx)
		return err
	}
	c := &pendingCommit{m: m, ctx: ctx, tx: tx, args: x.args, key: x.obs.Key, method: x.r.Method,
		status: status, headers: headers, answer: answer, done: make(chan error, 1)}
	go c.run()
	var err error
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
	m.logr().LogAttrs(context.Background(), level, msg,
		slog.String("source", key.Source), slog.String("event_id", key.EventID),
		slog.String("method", method), slog.Any("error", err))
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

// replay answers a duplicate with the stored response. Headers set by
// middleware outside this one stay; the stored ones are laid over them.
func (x *exchange) replay(s *stored) {
	dst := x.w.Header()
	for k, v := range s.header {
		dst[k] = append([]string(nil), v...) // the cache keeps its own
	}
	dst.Set("Idempotent-Replayed", "true")
	x.obs.Outcome = OutcomeReplayed
	x.send(s.status, s.body)
}

// answer sends the handler's own answer, after commit or rollback: the
// client sees exactly the headers the handler left on its writer.
func (x *exchange) answer(rec *recorder) {
	dst := x.w.Header()
	for k := range dst {
		if _, keep := rec.header[k]; !keep {
			delete(dst, k)
		}
	}
	for k, v := range rec.header {
		dst[k] = v
	}
	x.send(rec.finalStatus(), rec.body.Bytes())
}

func (x *exchange) send(status int, body []byte) {
	x.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	x.obs.Status = status
	x.observe()
	x.w.WriteHeader(status)
	_, _ = x.w.Write(body)
}

// fail answers with the middleware's own error.
func (x *exchange) fail(o Outcome, p *Problem) {
	p.Key = x.obs.Key
	if p.retryable() {
		retry := x.m.retryAfter
		if p.retryAfter != "" {
			retry = p.retryAfter
		}
		x.w.Header().Set("Retry-After", retry)
	}
	x.obs.Outcome, x.obs.Status, x.obs.Err = o, p.Status, p.Err
	level := slog.LevelInfo
	switch o {
	case OutcomeStoreError, OutcomeRolledBack:
		level = slog.LevelError
	}
	x.m.log(x, level, p.Title, p.Err)
	x.observe()
	x.m.errorHandler(x.w, x.r, p)
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
	m.logr().LogAttrs(x.r.Context(), level, "idem: "+msg,
		slog.String("source", x.obs.Key.Source),
		slog.String("event_id", x.obs.Key.EventID),
		slog.String("method", x.r.Method),
		slog.String("path", x.r.URL.Path),
		slog.Any("error", err))
}
