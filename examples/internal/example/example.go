// Package example holds the wiring the example programs share: where the
// database is, opening it with an error a person can act on, and serving
// HTTP until Ctrl-C. The examples' interesting code is in their own
// packages; this is the part every program would otherwise repeat.
package example

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// DefaultDatabaseURL is the database used when DATABASE_URL is not set: the
// local PostgreSQL, user postgres, trust authentication.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// StartPostgres tells how to get a PostgreSQL server running, for error
// messages.
const StartPostgres = "start one with `docker run -d -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust postgres:17` " +
	"(or `sudo service postgresql start`), or point DATABASE_URL at yours"

// DatabaseURLUsage describes a -database-url flag whose default is "",
// resolved by DatabaseURL: the help text then never prints the value of
// DATABASE_URL, which may hold a password.
const DatabaseURLUsage = "PostgreSQL URL (default: $DATABASE_URL, else " + DefaultDatabaseURL + ")"

// DatabaseURL returns $DATABASE_URL, or DefaultDatabaseURL when it is empty.
func DatabaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}

// Redact returns dsn with any password replaced by "xxxxx", fit to print.
// A DSN that is not a URL (key=value form) is not printed at all.
func Redact(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		return "the configured database"
	}
	return u.Redacted()
}

// OpenDB opens a pool on the PostgreSQL database at dsn and checks, within
// five seconds, that it answers. Its error is one line that says what to do.
func OpenDB(ctx context.Context, dsn string) (*sql.DB, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("invalid database URL %s: %s", Redact(dsn), OneLine(err))
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		// The server said no (authentication, a missing database): its
		// words. Nobody answered: the network's, and how to start one.
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return nil, fmt.Errorf("PostgreSQL at %s refused the connection: %s (SQLSTATE %s); check DATABASE_URL",
				Redact(dsn), pgErr.Message, pgErr.Code)
		}
		cause := OneLine(err)
		var netErr *net.OpError
		if errors.As(err, &netErr) {
			cause = netErr.Error()
		}
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s (%s): %s", Redact(dsn), cause, StartPostgres)
	}
	return db, nil
}

// OneLine flattens an error message, which drivers may spread over lines,
// into one line.
func OneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// Serve answers HTTP on addr with h until ctx is done, then shuts down,
// giving requests in flight ten seconds to finish.
func Serve(ctx context.Context, addr string, h http.Handler) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	log.Printf("listening on http://%s", ln.Addr())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Main is the whole main function of a simple example program: it parses
// -addr and -database-url, opens the database, lets setup migrate it and
// build the handler, and serves until SIGINT or SIGTERM. Errors are printed
// as one line, with exit status 1.
func Main(setup func(ctx context.Context, db *sql.DB) (http.Handler, error)) {
	addr := flag.String("addr", "127.0.0.1:8080", "address to listen on")
	dsn := flag.String("database-url", "", DatabaseURLUsage)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix(progName() + ": ")

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *dsn == "" {
		*dsn = DatabaseURL()
	}
	if err := run(ctx, *addr, *dsn, setup); err != nil {
		log.Print(err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, dsn string, setup func(context.Context, *sql.DB) (http.Handler, error)) error {
	db, err := OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	h, err := setup(ctx, db)
	if err != nil {
		return err
	}
	return Serve(ctx, addr, h)
}

func progName() string {
	name := os.Args[0]
	if i := strings.LastIndexAny(name, `/\`); i >= 0 {
		name = name[i+1:]
	}
	return name
}
