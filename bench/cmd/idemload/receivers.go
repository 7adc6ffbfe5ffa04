package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem/internal/benchref"

	"github.com/gofiber/fiber/v3"
	"github.com/gofiber/fiber/v3/middleware/idempotency"
	redisstore "github.com/gofiber/storage/redis/v3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idempgx"
	"github.com/redis/go-redis/v9"
)

// The receivers. Each answers POST /hook; every one that touches
// PostgreSQL does the same handler work (append a row to its ledger table
// and answer the row's id as JSON, status 201) on its own pool of the same
// size, and differs only in what it does around that work.
const (
	kindBare       = "bare"         // the ledger write in a plain transaction: no idempotency
	kindInline     = "inline"       // the seed's SQL by hand around the same write
	kindIdem       = "idem"         // idem's middleware around the same write
	kindIdemCold   = "idem-nocache" // idem with its replay cache off: every duplicate asks PostgreSQL
	kindIdemPgx    = "idempgx"      // idem's pgx adapter (idempgx) around the same write, on a pgxpool
	kindIdemOtel   = "idem-otel"    // idem with idemotel (every span sampled, the metrics), to measure its cost
	kindPgxOtel    = "idempgx-otel" // idempgx with idemotel, the same
	kindBarePgx    = "bare-pgx"     // the ledger write in a plain pgx transaction (pool.Begin, INSERT, Commit)
	kindPeer       = "peer"         // Fiber v3 middleware/idempotency with Redis storage
	kindHTTPFloor  = "http-floor"   // net/http, no database: the HTTP stack's own ceiling
	kindFiberFloor = "fiber-floor"  // Fiber, no database: the same for the peer's stack
)

const (
	eventHeader = benchref.EventHeader
	source      = benchref.Source
)

// peerCaveat is printed with every report that includes the peer.
const peerCaveat = `The peer (Fiber v3 middleware/idempotency + github.com/gofiber/storage/redis/v3) is faster
on paper because it guarantees less. It does NOT guarantee:
  - exactly once across processes: its lock is a mutex inside one process; two instances,
    or a restart, run an in-flight duplicate twice;
  - atomicity with the handler's writes: the ledger COMMIT and the Redis SET are separate,
    so a crash or a Redis failure between them runs the handler again on redelivery;
  - a payload check: a key reused with a different body is answered the first body's
    response, not 422;
  - bounded waits: an in-flight duplicate waits on the mutex as long as the original runs;
  - answers that outlive Redis: they expire with the TTL (10 min here, 30 min by default)
    and with whatever Redis persistence keeps;
  - final statuses only: it stores every answer the handler returns without a Go error,
    4xx and 5xx included.`

// receiver is one server under load, with what the sender needs to know.
type receiver struct {
	name       string
	url        string // POST target
	idempotent bool   // duplicates must be answered with the first answer
	usesDB     bool
	db         *sql.DB       // setup, checks, and the database/sql receivers' pool
	pgx        *pgxpool.Pool // the pgx receivers' pool
	ledger     string        // ledger table
	keys       string        // idempotency table (idem, inline)
	client     *http.Client
	stop       func()
	otelStop   func() // idemotel's SDK, shut down with the receiver

	bucket atomic.Pointer[bucket] // where statement counts go now; nil: nowhere
	prefix string                 // of the event ids this receiver is sent
	seq    atomic.Int64
	seeded []seededKey

	// totals over the measured slots of the current mix
	res *mixResult
}

type seededKey struct {
	id     string
	body   []byte
	answer []byte // what the first delivery was answered; nil: not checked
}

func (rc *receiver) count(c *reqCount, path string) {
	if b := rc.bucket.Load(); b != nil {
		b.paths[pathOf(path)].add(c)
	}
}

// env is what building receivers needs.
type env struct {
	dbURL string
	citus bool // distribute the tables (config.Citus)
	pool  int
	conc  int
	run   string // this run's id, in every event id
	redis *redisstore.Storage
}

// newReceiver builds and starts a receiver of kind; instance names a
// second instance of the same kind (the cold seeder) sharing its tables.
func newReceiver(ctx context.Context, e *env, kind string, shared *receiver) (*receiver, error) {
	rc := &receiver{name: kind, prefix: e.run + kind + ":"}
	switch kind {
	case kindBare, kindInline, kindIdem, kindIdemCold, kindPeer, kindIdemPgx, kindBarePgx, kindIdemOtel, kindPgxOtel:
		rc.usesDB = true
		rc.idempotent = kind != kindBare && kind != kindBarePgx
	}
	if rc.usesDB {
		db, err := openCounted(e.dbURL, e.pool)
		if err != nil {
			return nil, err
		}
		rc.db = db
		rc.ledger = "ledger_" + sqlName(kind)
		rc.keys = "keys_" + sqlName(kind)
		if shared == nil {
			if err := rc.createTables(ctx, kind, e.citus); err != nil {
				db.Close()
				return nil, err
			}
		}
	}
	var err error
	if kind == kindIdemPgx || kind == kindBarePgx || kind == kindPgxOtel {
		rc.pgx, err = openPgx(ctx, e.dbURL, e.pool)
		if err != nil {
			rc.db.Close()
			return nil, err
		}
	}
	switch kind {
	case kindBarePgx:
		err = rc.serveHTTP(benchref.BarePgxHandler(rc.pgx, rc.ledger))
	case kindIdemPgx, kindPgxOtel:
		opts := idem.Options{KeyFunc: idem.Header(source, eventHeader), Table: rc.keys}
		if kind == kindPgxOtel {
			err = rc.instrument(&opts)
		}
		var m *idem.Middleware
		if err == nil {
			m, err = idempgx.New(rc.pgx, opts)
		}
		if err == nil {
			err = rc.serveHTTP(m.Handler(benchref.IdemPgxHandler(rc.ledger)))
		}
	case kindBare:
		err = rc.serveHTTP(benchref.BareHandler(rc.db, rc.ledger))
	case kindInline:
		err = rc.serveHTTP(benchref.InlineHandler(rc.db, rc.keys, rc.ledger))
	case kindIdem, kindIdemCold, kindIdemOtel:
		opts := idem.Options{KeyFunc: idem.Header(source, eventHeader), Table: rc.keys}
		if kind == kindIdemCold {
			opts.ReplayCacheBytes = -1
		}
		if kind == kindIdemOtel {
			err = rc.instrument(&opts)
		}
		var m *idem.Middleware
		if err == nil {
			m, err = idem.New(rc.db, opts)
		}
		if err == nil {
			err = rc.serveHTTP(m.Handler(benchref.IdemHandler(rc.ledger)))
		}
	case kindHTTPFloor:
		err = rc.serveHTTP(floorHandler())
	case kindPeer:
		err = rc.serveFiber(e, true)
	case kindFiberFloor:
		err = rc.serveFiber(e, false)
	default:
		err = fmt.Errorf("unknown receiver %q", kind)
	}
	if err != nil {
		rc.closePools()
		if rc.otelStop != nil {
			rc.otelStop()
		}
		return nil, err
	}
	rc.client = &http.Client{Transport: &http.Transport{
		MaxIdleConns:        e.conc,
		MaxIdleConnsPerHost: e.conc,
		MaxConnsPerHost:     e.conc,
		IdleConnTimeout:     time.Minute,
		DisableCompression:  true,
	}}
	return rc, nil
}

func sqlName(kind string) string {
	b := []byte(kind)
	for i, c := range b {
		if c == '-' {
			b[i] = '_'
		}
	}
	return string(b)
}

func (rc *receiver) createTables(ctx context.Context, kind string, citus bool) error {
	key := `id bigserial PRIMARY KEY`
	if citus {
		// Citus enforces a primary key only with the distribution column
		// in it; the tables of an earlier run go first.
		key = `id bigserial, PRIMARY KEY (event_id, id)`
		if _, err := rc.db.ExecContext(ctx, `DROP TABLE IF EXISTS `+rc.ledger+`, `+rc.keys); err != nil {
			return err
		}
	}
	if _, err := rc.db.ExecContext(ctx, `CREATE TABLE `+rc.ledger+` (
		event_id text NOT NULL, body bytea NOT NULL, `+key+`)`); err != nil {
		return fmt.Errorf("create %s: %w", rc.ledger, err)
	}
	if citus {
		if _, err := rc.db.ExecContext(ctx, `SELECT create_distributed_table($1, 'event_id')`, rc.ledger); err != nil {
			return fmt.Errorf("distribute %s: %w", rc.ledger, err)
		}
	}
	if hasKeyTable(kind) {
		// The inline handler uses idem's own schema, so both pay for the same
		// table and index.
		if err := idem.Migrate(ctx, rc.db, rc.keys); err != nil {
			return err
		}
		if citus {
			if _, err := idemops.Distribute(ctx, rc.db, idemops.DistributeOptions{Table: rc.keys, ColocateWith: rc.ledger}); err != nil {
				return err
			}
		}
	}
	return nil
}

// hasKeyTable: the receiver keeps its keys in an idem-schema table.
func hasKeyTable(kind string) bool {
	switch kind {
	case kindIdem, kindIdemCold, kindInline, kindIdemPgx, kindIdemOtel, kindPgxOtel:
		return true
	}
	return false
}

// openPgx opens the pgx receivers' pool of size connections.
func openPgx(ctx context.Context, url string, size int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(size)
	cfg.ConnConfig.Tracer = countingTracer{} // the round trips in the report
	return pgxpool.NewWithConfig(ctx, cfg)
}

func (rc *receiver) closePools() {
	if rc.pgx != nil {
		rc.pgx.Close()
	}
	if rc.db != nil {
		rc.db.Close()
	}
}

func (rc *receiver) close() {
	if rc.stop != nil {
		rc.stop()
	}
	rc.client.CloseIdleConnections()
	rc.closePools()
	if rc.otelStop != nil {
		rc.otelStop()
	}
}

// serveHTTP serves h with net/http on a loopback port, behind the wrapper
// that counts each request's statements.
func (rc *receiver) serveHTTP(h http.Handler) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c := &reqCount{}
		h.ServeHTTP(w, r.WithContext(withCount(r.Context(), c)))
		rc.count(c, r.Header.Get(pathHeader))
	})
	srv := &http.Server{Handler: outer, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	rc.url = "http://" + ln.Addr().String() + "/hook"
	rc.stop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}
	return nil
}

// serveFiber serves the peer (withDB) or the Fiber floor on a loopback port.
func (rc *receiver) serveFiber(e *env, withDB bool) error {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return err
	}
	app := fiber.New()
	app.Use(func(c fiber.Ctx) error {
		n := &reqCount{}
		c.Locals(reqCountKey{}, n) // what the Redis hook finds through c
		c.SetContext(withCount(c.Context(), n))
		err := c.Next()
		rc.count(n, c.Get(pathHeader))
		return err
	})
	if withDB {
		if e.redis == nil {
			return errors.New("the peer needs Redis")
		}
		app.Use(idempotency.New(idempotency.Config{
			Storage:             e.redis,
			KeyHeader:           eventHeader,
			KeyHeaderValidate:   func(k string) error { return nil }, // the default wants 36 bytes (a UUID)
			KeepResponseHeaders: []string{"Content-Type"},
			Lifetime:            10 * time.Minute,
		}))
		db, ledger := rc.db, rc.ledger
		app.Post("/hook", func(c fiber.Ctx) error {
			ctx := c.Context()
			eventID := c.Get(eventHeader)
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return c.Status(http.StatusServiceUnavailable).SendString("begin")
			}
			defer func() { _ = tx.Rollback() }()
			id, err := benchref.LedgerInsert(ctx, tx, ledger, eventID, c.Body())
			if err != nil {
				return c.Status(http.StatusInternalServerError).SendString("ledger write failed")
			}
			if err := tx.Commit(); err != nil {
				return c.Status(http.StatusServiceUnavailable).SendString("commit")
			}
			c.Set("Content-Type", "application/json")
			return c.Status(http.StatusCreated).Send(benchref.Answer(id, eventID))
		})
	} else {
		answer := []byte(`{"ledger_id":0,"event":"floor"}` + "\n")
		app.Post("/hook", func(c fiber.Ctx) error {
			_ = c.Body()
			c.Set("Content-Type", "application/json")
			return c.Status(http.StatusCreated).Send(answer)
		})
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = app.Listener(ln, fiber.ListenConfig{DisableStartupMessage: true})
	}()
	rc.url = "http://" + ln.Addr().String() + "/hook"
	rc.stop = func() {
		_ = app.ShutdownWithTimeout(5 * time.Second)
		<-done
	}
	return nil
}

// ---- the handler work ---------------------------------------------------------

// floorHandler reads the body and answers a fixed 201: no database.
func floorHandler() http.Handler {
	answer := []byte(`{"ledger_id":0,"event":"floor"}` + "\n")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		benchref.WriteJSON(w, http.StatusCreated, answer)
	})
}

// ---- Redis -----------------------------------------------------------------------

// redisUp reports whether a Redis server answers PING at addr.
func redisUp(addr string) bool {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 300 * time.Millisecond,
		ReadTimeout: 300 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return c.Ping(ctx).Err() == nil
}

// redisCounter counts the peer's Redis commands into the request's
// counter, which Fiber's context carries as a local.
type redisCounter struct{}

func (redisCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (redisCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		countFrom(ctx).redis.Add(1)
		return next(ctx, cmd)
	}
}

func (redisCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		countFrom(ctx).redis.Add(1)
		return next(ctx, cmds)
	}
}

// openRedis connects the peer's storage, counting its commands.
func openRedis(addr string, poolSize int) (*redisstore.Storage, error) {
	host, portS, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	port, err := strconv.Atoi(portS)
	if err != nil {
		return nil, err
	}
	s := redisstore.New(redisstore.Config{Host: host, Port: port, PoolSize: poolSize})
	s.Conn().AddHook(redisCounter{})
	return s, nil
}

// deleteRedisKeys removes this run's keys (they would expire anyway).
func deleteRedisKeys(s *redisstore.Storage, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := s.Conn()
	var cursor uint64
	for i := 0; i < 100000; i++ {
		keys, next, err := c.Scan(ctx, cursor, prefix+"*", 1000).Result()
		if err != nil {
			return
		}
		if len(keys) > 0 {
			c.Del(ctx, keys...)
		}
		if cursor = next; cursor == 0 {
			return
		}
	}
}
