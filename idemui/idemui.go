// Package idemui is the operator's web view of an idem idempotency table:
// an http.Handler to mount under an admin route of your own, behind your
// own authentication.
//
//	ui, err := idemui.New(db, idemui.Options{})
//	if err != nil { ... }
//	defer ui.Close()
//	mux.Handle("/admin/idem/", requireAdmin(http.StripPrefix("/admin/idem", ui)))
//
// It shows an overview per source (claims per hour, completion latency,
// unanswered keys, leases, claims in flight, partitions, the durability of
// answers), finds a key by source and event id or by event id alone, shows
// a key's state and stored answer, and lists the keys that need a look. It
// is read-only unless Options.AllowRelease, and never shows a stored body
// unless Options.ShowBodies. It never assumes it is safe to expose: it has
// no authentication of its own, so mount it behind yours (docs/operator-ui.md
// shows basic auth).
//
// Pages are rendered on the server with html/template, which escapes
// everything a sender chose (sources and event ids); the styles are
// embedded and there is no script. The overview's aggregates come from a
// snapshot that a goroutine refreshes in the background
// (Options.RefreshEvery), not from a scan per page view; the other pages
// read one key, or a bounded list, through the table's indexes.
package idemui

import (
	"context"
	"crypto/rand"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/pgidem/idem/idemops"
)

// Defaults, for the zero values of Options.
const (
	// DefaultRefreshEvery is how often the overview's snapshot is taken.
	DefaultRefreshEvery = time.Minute
	// DefaultRefreshTimeout bounds one snapshot's queries.
	DefaultRefreshTimeout = 30 * time.Second
)

// Options configures the handler. The zero value of every field means its
// documented default: the default table, read-only, no bodies.
type Options struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it.
	Table string

	// AllowRelease offers to release (forget) a key from its page, behind
	// a confirmation page and a token against cross-site request forgery,
	// with the refusals of idemops.ForgetKey (a key in flight, a live
	// lease) unless the operator ticks "force". Off by default: the UI is
	// read-only.
	AllowRelease bool

	// ShowBodies shows the stored response body on a key's page. Off by
	// default: bodies can hold personal data.
	ShowBodies bool

	// Retention is the sweeper's retention (idemops.SweepOptions.Retention):
	// the window of the overview's chart, and what the health check
	// measures against. 0 means idemops.DefaultRetention (30 days).
	Retention time.Duration
	// Horizon is the longest retry horizon of the table's senders, for the
	// health check. 0 means idemops.DefaultHorizon (72h).
	Horizon time.Duration

	// RefreshEvery is how often the overview's snapshot is taken in the
	// background. Each snapshot reads the whole table about three times
	// (idemops.Check, idemops.Stats and the chart), so keep it in minutes
	// on a large table. 0 means DefaultRefreshEvery (1m).
	RefreshEvery time.Duration
	// RefreshTimeout bounds one snapshot: its queries are cancelled after
	// it, and the page shows the previous snapshot with the error. 0 means
	// DefaultRefreshTimeout (30s).
	RefreshTimeout time.Duration

	// Actor names who releases a key, for the audit log line; nil means
	// the user name of the request's basic auth, if any.
	Actor func(r *http.Request) string

	// Logger receives refresh errors and the audit line of each release;
	// nil means slog.Default().
	Logger *slog.Logger
}

// Handler is the operator UI: an http.Handler. Create it with New, mount
// it under a prefix with http.StripPrefix, and Close it on shutdown.
type Handler struct {
	db     *sql.DB
	opts   Options
	log    *slog.Logger
	pages  map[string]*template.Template
	mux    *http.ServeMux
	secret [32]byte // signs the release tokens

	mu   sync.Mutex
	snap *snapshot // nil until the first refresh ends

	refreshMu sync.Mutex // one refresh at a time
	stop      context.CancelFunc
	done      chan struct{}
}

//go:embed assets
var assets embed.FS

// New returns the handler and starts its background refresh; Close stops
// it. Invalid options are an error. The first snapshot is taken at once in
// the background; until it is there the overview says so.
func New(db *sql.DB, opts Options) (*Handler, error) {
	if db == nil {
		return nil, errors.New("idem: idemui.New: db is nil")
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"Retention", &opts.Retention, idemops.DefaultRetention},
		{"Horizon", &opts.Horizon, idemops.DefaultHorizon},
		{"RefreshEvery", &opts.RefreshEvery, DefaultRefreshEvery},
		{"RefreshTimeout", &opts.RefreshTimeout, DefaultRefreshTimeout},
	} {
		switch {
		case *d.v < 0:
			return nil, fmt.Errorf("idem: idemui.Options.%s %v is negative", d.name, *d.v)
		case *d.v == 0:
			*d.v = d.def
		}
	}
	// The table name is checked by a call that reads nothing much.
	if _, err := idemops.ListKeys(context.Background(), db, idemops.ListOptions{Table: opts.Table, Limit: 1, Since: time.Now().Add(time.Hour)}); err != nil {
		return nil, fmt.Errorf("idem: idemui.New: %w", err)
	}
	h := &Handler{db: db, opts: opts, log: opts.Logger, done: make(chan struct{})}
	if h.log == nil {
		h.log = slog.Default()
	}
	if _, err := rand.Read(h.secret[:]); err != nil {
		return nil, err
	}
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	h.pages = pages
	h.mux = h.routes()
	ctx, cancel := context.WithCancel(context.Background())
	h.stop = cancel
	go h.refreshLoop(ctx)
	return h, nil
}

// Close stops the background refresh and waits for it to end. The handler
// still serves pages, from its last snapshot.
func (h *Handler) Close() {
	h.stop()
	<-h.done
}

// ServeHTTP serves the pages: the overview at "/", "/search", "/key",
// "/keys" and, when AllowRelease, "/release". Mount it with
// http.StripPrefix; its links are relative, so a prefix ending in "/"
// works unchanged.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	w.Header().Set("Cache-Control", "no-store")
	h.mux.ServeHTTP(w, r)
}

func (h *Handler) refreshLoop(ctx context.Context) {
	defer close(h.done)
	t := time.NewTicker(h.opts.RefreshEvery)
	defer t.Stop()
	for {
		if err := h.Refresh(ctx); err != nil && ctx.Err() == nil {
			h.log.Error("idem: idemui: refresh of the overview failed", slog.String("table", h.opts.Table), slog.Any("error", err))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Refresh takes a new snapshot for the overview now, within
// Options.RefreshTimeout, and returns its error (the overview then keeps
// the previous snapshot and shows the error). The background refresh calls
// it every Options.RefreshEvery; call it yourself after a change you want
// the overview to show at once.
func (h *Handler) Refresh(ctx context.Context) error {
	h.refreshMu.Lock()
	defer h.refreshMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, h.opts.RefreshTimeout)
	defer cancel()
	s, err := takeSnapshot(ctx, h.db, h.opts)
	h.mu.Lock()
	defer h.mu.Unlock()
	if err != nil {
		// The page says that it failed, not why: the error can hold SQL
		// or the server's address, and the log has it.
		msg := "the database did not answer; the server's log has the error"
		if errors.Is(err, context.DeadlineExceeded) {
			msg = fmt.Sprintf("it took longer than RefreshTimeout (%v)", h.opts.RefreshTimeout)
		}
		if h.snap != nil {
			old := *h.snap
			old.Err = msg
			h.snap = &old
		} else {
			h.snap = &snapshot{Err: msg}
		}
		return err
	}
	h.snap = s
	return nil
}

// snapshotNow returns the current snapshot, nil before the first.
func (h *Handler) snapshotNow() *snapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.snap
}
