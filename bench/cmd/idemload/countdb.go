package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// Statement accounting. Every receiver that talks to PostgreSQL through
// database/sql does so on a pool made by openCounted, whose driver wraps
// pgx's and counts BEGIN, Query, Exec, COMMIT and ROLLBACK (the pgx
// receivers' pools count with countingTracer): each is one round trip to
// the server (pgx's statement cache prepares a statement once
// per connection; the seeding and warm-up requests absorb that). The counts
// go to the reqCount found in the statement's context, which the receivers'
// outer wrapper puts there for each request; a transaction remembers the
// reqCount of the context it was begun with, for COMMIT and ROLLBACK.

type reqCountKey struct{}

// reqCount is what one request sent to PostgreSQL and Redis.
type reqCount struct {
	begin, query, exec, commit, rollback atomic.Int32
	business                             atomic.Int32 // the handler's own ledger INSERT
	redis                                atomic.Int32 // the peer's Redis commands
}

func withCount(ctx context.Context, c *reqCount) context.Context {
	return context.WithValue(ctx, reqCountKey{}, c)
}

// countFrom returns the request's counter, or the sink for statements sent
// outside any request (setup, checks).
func countFrom(ctx context.Context) *reqCount {
	if c, ok := ctx.Value(reqCountKey{}).(*reqCount); ok {
		return c
	}
	return &untracked
}

var untracked reqCount

// businessPrefix marks the handler's own statement: the ledger INSERT.
const businessPrefix = "INSERT INTO ledger_"

// openCounted opens a pool of size connections on url, counting statements.
func openCounted(url string, size int) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(&countingConnector{inner: stdlib.GetConnector(*cfg)})
	db.SetMaxOpenConns(size)
	db.SetMaxIdleConns(size) // database/sql keeps 2 by default: it would reconnect under load
	return db, nil
}

type countingConnector struct{ inner driver.Connector }

func (cc *countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := cc.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	full, ok := conn.(fullConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("idemload: the driver's connection %T lacks an interface the counter needs", conn)
	}
	return &countingConn{full}, nil
}

func (cc *countingConnector) Driver() driver.Driver { return cc.inner.Driver() }

// fullConn is what pgx's stdlib connection implements; countingConn keeps
// every one of those interfaces, so database/sql behaves as with pgx alone.
type fullConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ExecerContext
	driver.QueryerContext
	driver.ConnPrepareContext
	driver.Pinger
	driver.SessionResetter
	driver.NamedValueChecker
}

type countingConn struct{ fullConn }

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	n := countFrom(ctx)
	n.begin.Add(1)
	tx, err := c.fullConn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, n: n}, nil
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	n := countFrom(ctx)
	n.exec.Add(1)
	if strings.HasPrefix(q, businessPrefix) {
		n.business.Add(1)
	}
	return c.fullConn.ExecContext(ctx, q, args)
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	n := countFrom(ctx)
	n.query.Add(1)
	if strings.HasPrefix(q, businessPrefix) {
		n.business.Add(1)
	}
	return c.fullConn.QueryContext(ctx, q, args)
}

type countingTx struct {
	driver.Tx
	n *reqCount
}

func (t *countingTx) Commit() error   { t.n.commit.Add(1); return t.Tx.Commit() }
func (t *countingTx) Rollback() error { t.n.rollback.Add(1); return t.Tx.Rollback() }

// pathStats sums the counts of the requests of one path (new or duplicate)
// to one receiver within one mix.
type pathStats struct {
	requests                             atomic.Int64
	begin, query, exec, commit, rollback atomic.Int64
	business, redis                      atomic.Int64
}

func (p *pathStats) add(c *reqCount) {
	p.requests.Add(1)
	p.begin.Add(int64(c.begin.Load()))
	p.query.Add(int64(c.query.Load()))
	p.exec.Add(int64(c.exec.Load()))
	p.commit.Add(int64(c.commit.Load()))
	p.rollback.Add(int64(c.rollback.Load()))
	p.business.Add(int64(c.business.Load()))
	p.redis.Add(int64(c.redis.Load()))
}

// Stmts is the per-request average of one path, for the report.
type Stmts struct {
	Requests int64   `json:"requests"`
	Begin    float64 `json:"begin"`
	Query    float64 `json:"query"`
	Exec     float64 `json:"exec"`
	Commit   float64 `json:"commit"`
	Rollback float64 `json:"rollback"`
	Total    float64 `json:"total"`    // every statement: round trips to PostgreSQL
	Business float64 `json:"business"` // the handler's ledger INSERT
	Added    float64 `json:"added"`    // total - business: what idempotency and the transaction cost
	Redis    float64 `json:"redis"`    // Redis commands (the peer)
}

func (p *pathStats) snapshot() Stmts {
	n := p.requests.Load()
	if n == 0 {
		return Stmts{}
	}
	per := func(v *atomic.Int64) float64 { return float64(v.Load()) / float64(n) }
	s := Stmts{Requests: n, Begin: per(&p.begin), Query: per(&p.query), Exec: per(&p.exec),
		Commit: per(&p.commit), Rollback: per(&p.rollback), Business: per(&p.business), Redis: per(&p.redis)}
	s.Total = s.Begin + s.Query + s.Exec + s.Commit + s.Rollback
	s.Added = s.Total - s.Business
	return s
}

// bucket collects the statement counts of one receiver in one mix.
type bucket struct{ paths [2]pathStats } // pathNew, pathDup

const (
	pathNew = 0
	pathDup = 1
)

// pathHeader tells the receiver's counting wrapper which path the sender
// meant a request to take.
const pathHeader = "X-Bench-Path"

func pathOf(v string) int {
	if v == "dup" {
		return pathDup
	}
	return pathNew
}

// countingTracer counts the pgx receivers' round trips, as countingConn
// counts database/sql's: set as the pool's tracer by openPgx. A query is
// one round trip; a batch, which pgx sends in one, is one too, counted as
// BEGIN when it begins a transaction, as COMMIT or ROLLBACK when it ends
// one, and as a query otherwise.
type countingTracer struct{}

func (countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	n := countFrom(ctx)
	switch {
	case isVerb(d.SQL, "begin"):
		n.begin.Add(1)
	case isVerb(d.SQL, "commit"):
		n.commit.Add(1)
	case isVerb(d.SQL, "rollback"):
		n.rollback.Add(1)
	default:
		n.query.Add(1)
	}
	if strings.HasPrefix(d.SQL, businessPrefix) {
		n.business.Add(1)
	}
	return ctx
}

func (countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (countingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	n, qs := countFrom(ctx), d.Batch.QueuedQueries
	switch {
	case len(qs) > 0 && isVerb(qs[0].SQL, "begin"):
		n.begin.Add(1)
	case len(qs) > 0 && isVerb(qs[len(qs)-1].SQL, "commit"):
		n.commit.Add(1)
	case len(qs) > 0 && isVerb(qs[len(qs)-1].SQL, "rollback"):
		n.rollback.Add(1)
	default:
		n.query.Add(1)
	}
	for _, q := range qs {
		if strings.HasPrefix(q.SQL, businessPrefix) {
			n.business.Add(1)
		}
	}
	return ctx
}

func (countingTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (countingTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// isVerb reports whether a statement's first word is verb, in any case
// (without allocating: the tracer runs in the measured requests).
func isVerb(sql, verb string) bool {
	sql = strings.TrimSpace(sql)
	if i := strings.IndexAny(sql, " \t\n;"); i >= 0 {
		sql = sql[:i]
	}
	return strings.EqualFold(sql, verb)
}
