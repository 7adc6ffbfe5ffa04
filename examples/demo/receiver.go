package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem"
)

// receiver is the orders receiver under test: an HTTP server on loopback,
// its tables in a schema of its own, and what the middleware observed.
type receiver struct {
	db      *sql.DB
	schema  string
	ledger  string // the ledger table, schema-qualified
	url     string
	srv     *http.Server
	slowFor time.Duration

	outcomes      [8]atomic.Int64 // by idem.Outcome
	waitedReplays atomic.Int64    // replays that first waited for their original
}

// orderEvent is the payload the storm sends.
type orderEvent struct {
	ID     string `json:"id"`
	Type   string `json:"type"`
	Amount int64  `json:"amount"`
	Slow   bool   `json:"slow,omitempty"` // the handler takes slowFor: lets duplicates find it in flight
}

// startReceiver creates this run's schema and tables and starts the server.
func startReceiver(ctx context.Context, db *sql.DB, cfg config) (_ *receiver, err error) {
	pool := min(cfg.concurrency, 40)
	db.SetMaxOpenConns(pool)
	db.SetMaxIdleConns(pool)

	var b [3]byte
	_, _ = rand.Read(b[:])
	rc := &receiver{db: db, slowFor: cfg.slowFor}
	rc.schema = "idem_demo_" + time.Now().Format("20060102_150405") + "_" + hex.EncodeToString(b[:])
	rc.ledger = rc.schema + ".ledger"
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA "+rc.schema); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", rc.schema, err)
	}
	defer func() {
		if err != nil {
			_ = rc.dropSchema()
		}
	}()
	table := rc.schema + ".webhook_idempotency"
	if err := idem.Migrate(ctx, db, table); err != nil {
		return nil, err
	}
	_, err = db.ExecContext(ctx, `CREATE TABLE `+rc.ledger+` (
		id         bigserial   PRIMARY KEY,
		event_id   text        NOT NULL,
		amount     bigint      NOT NULL,
		written_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		return nil, fmt.Errorf("create the ledger: %w", err)
	}

	var h http.Handler = http.HandlerFunc(rc.appendToLedger)
	if !cfg.noIdem {
		mw, err := idem.New(db, idem.Options{
			KeyFunc: idem.JSONField("orders", "id"),
			Table:   table,
			// Short, so that duplicates of the slow originals hear 409
			// and retry, as real senders do.
			LockWait:   cfg.lockWait,
			RetryAfter: time.Second,
			Observer:   rc.observe,
			// The demo counts every answer itself; the expected 409s and
			// 422s would otherwise fill the screen. Warnings still show.
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		})
		if err != nil {
			return nil, err
		}
		h = mw.Handler(h)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", h)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	rc.url = "http://" + ln.Addr().String() + "/orders"
	rc.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = rc.srv.Serve(ln) }()
	return rc, nil
}

// appendToLedger is the orders handler: it appends one ledger row per run,
// through the middleware's transaction when there is one, and answers with
// the row's id. It is not idempotent on its own: run twice, it writes twice.
func (rc *receiver) appendToLedger(w http.ResponseWriter, r *http.Request) {
	var ev orderEvent
	if err := json.NewDecoder(r.Body).Decode(&ev); err != nil || ev.ID == "" {
		http.Error(w, "not an order event", http.StatusBadRequest)
		return
	}
	if ev.Slow {
		select { // some slow work: a call to a payment provider, say
		case <-time.After(rc.slowFor):
		case <-r.Context().Done():
		}
	}
	var q interface {
		QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	} = rc.db // -no-idem: autocommit
	if tx, ok := idem.Tx(r.Context()); ok {
		q = tx
	}
	var id int64
	err := q.QueryRowContext(r.Context(), `INSERT INTO `+rc.ledger+` (event_id, amount) VALUES ($1, $2) RETURNING id`,
		ev.ID, ev.Amount).Scan(&id)
	if err != nil {
		http.Error(w, "ledger write failed", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"ledger_id":%d,"event":%q,"amount":%d}`+"\n", id, ev.ID, ev.Amount)
}

// observe is the middleware's Observer: it counts outcomes.
func (rc *receiver) observe(o idem.Observation) {
	if int(o.Outcome) < len(rc.outcomes) {
		rc.outcomes[o.Outcome].Add(1)
	}
	if o.Outcome == idem.OutcomeReplayed && o.Wait > 0 {
		rc.waitedReplays.Add(1)
	}
}

// close stops the server and drops the schema, unless keep.
func (rc *receiver) close(keep bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := rc.srv.Shutdown(ctx)
	if !keep {
		err = errors.Join(err, rc.dropSchema())
	}
	return err
}

func (rc *receiver) dropSchema() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := rc.db.ExecContext(ctx, "DROP SCHEMA IF EXISTS "+rc.schema+" CASCADE")
	return err
}
