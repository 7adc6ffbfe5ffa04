// Command testreceiver is a webhook receiver behind idem, for the tests
// that run several instances of one program against one database: it writes
// each event to a ledger table inside idem's transaction and answers with
// the ledger row's id.
//
//	testreceiver -database-url URL -table T -ledger L [-addr 127.0.0.1:0] [-adapter sql|pgx] [-lease D]
//
// -adapter pgx serves through idempgx on a pgx pool (default: the
// IDEM_ADAPTER environment variable, else database/sql). -lease turns on
// lease mode. A request with the header X-Hold: 1 writes its ledger row,
// prints "held <event id>" on standard output, and then waits until its
// context ends before it answers, as a handler stuck in a slow call does.
//
// It prints the address it listens on as the first line of its standard
// output, logs to standard error, and shuts down gracefully on SIGTERM or
// SIGINT. The idempotency table is migrated at start (safe from several
// processes at once); the ledger table must exist: ledger (id bigserial,
// event_id text, body bytea).
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "testreceiver:", err)
		os.Exit(1)
	}
}

func run() error {
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on; the bound address is printed on stdout")
	dbURL := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL")
	table := flag.String("table", idem.DefaultTable, "idempotency table")
	ledger := flag.String("ledger", "ledger", "ledger table the handler appends to")
	maxConns := flag.Int("max-conns", 4, "most open database connections")
	lockWait := flag.Duration("lock-wait", idem.DefaultLockWait, "idem LockWait")
	adapter := flag.String("adapter", os.Getenv("IDEM_ADAPTER"), "sql (database/sql, the default) or pgx (idempgx)")
	lease := flag.Duration("lease", 0, "idem Lease (0: single-transaction mode)")
	flag.Parse()

	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	db, err := sql.Open("pgx", *dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(*maxConns)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := idem.Migrate(ctx, db, *table); err != nil {
		return err
	}
	opts := idem.Options{
		KeyFunc:  idem.Header("test", "X-Event-Id"),
		Table:    *table,
		LockWait: *lockWait,
		Lease:    *lease,
		Logger:   logger,
	}
	var mw *idem.Middleware
	switch *adapter {
	case "", "sql":
		mw, err = idem.New(db, opts)
	case "pgx":
		cfg, perr := pgxpool.ParseConfig(*dbURL)
		if perr != nil {
			return perr
		}
		cfg.MaxConns = int32(*maxConns)
		pool, perr := pgxpool.NewWithConfig(ctx, cfg)
		if perr != nil {
			return perr
		}
		defer pool.Close()
		mw, err = idempgx.New(pool, opts)
	default:
		err = fmt.Errorf("-adapter %q: want sql or pgx", *adapter)
	}
	if err != nil {
		return err
	}
	insert := `INSERT INTO ` + *ledger + ` (event_id, body) VALUES ($1, $2) RETURNING id`
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := idem.KeyFromContext(r.Context())
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "read body", http.StatusInternalServerError)
			return
		}
		var row interface{ Scan(...any) error }
		if tx, ok := idem.Tx(r.Context()); ok {
			row = tx.QueryRowContext(r.Context(), insert, key.EventID, body)
		} else if tx, ok := idempgx.Tx(r.Context()); ok {
			row = tx.QueryRow(r.Context(), insert, key.EventID, body)
		} else {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		var id int64
		if err := row.Scan(&id); err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		if r.Header.Get("X-Hold") != "" {
			fmt.Println("held", key.EventID)
			<-r.Context().Done()
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "{\"ledger_id\": %d, \"event\": %s}\n", id, strconv.Quote(key.EventID))
	})

	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           mw.Handler(handler),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
	}
	fmt.Println(ln.Addr().String())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
