package driver

import (
	"database/sql"
	sqldriver "database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"
)

// Every combination of the columns a statement returns for a key becomes
// the State the engine switches on, in Scan.Row only.
func TestScanTurnsColumnsIntoOneState(t *testing.T) {
	digest := []byte{1}
	for _, c := range []struct {
		name         string
		locked       bool
		digest       []byte
		done, leased bool
		left         time.Duration
		want         State
	}{
		{"no row, the lock is ours", true, nil, false, false, 0, Free},
		{"no row, another holds the lock", false, nil, false, false, 0, InFlight},
		{"an answer, whoever holds the lock", false, digest, true, false, 0, Completed},
		{"an answer, the lock ours", true, digest, true, false, 0, Completed},
		{"a row committed without an answer", true, digest, false, false, 0, Unanswered},
		{"a lease that runs", false, digest, false, true, time.Second, LeaseLive},
		{"a lease that runs, the lock ours", true, digest, false, true, time.Second, LeaseLive},
		{"a lease that ran out, the lock ours", true, digest, false, true, 0, LeaseExpired},
		{"a lease that ran out, another holds the lock", false, digest, false, true, -time.Second, TakingOver},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := Scan{Locked: c.locked}
			dest := s.Columns()
			*dest[0].(*[]byte) = c.digest
			*dest[1].(*int64) = 201
			*dest[4].(*bool) = c.done
			*dest[5].(*bool) = c.leased
			*dest[6].(*time.Duration) = c.left
			row := s.Row()
			if row.State != c.want {
				t.Fatalf("state %d, want %d", row.State, c.want)
			}
			if row.Status != 201 || row.LeaseLeft != c.left {
				t.Fatalf("status %d, lease left %v", row.Status, row.LeaseLeft)
			}
		})
	}
}

// A lookup's first column is the key's lock, and a trailing column (the
// lock_timeout a wait restores) comes after the row's.
func TestLookupReadsTheLockFirstAndTrailLast(t *testing.T) {
	var (
		restored string
		s        Scan
	)
	dest := s.Lookup(&restored)
	if len(dest) != 9 {
		t.Fatalf("%d columns", len(dest))
	}
	*dest[0].(*bool) = true
	*dest[8].(*string) = "0"
	if row := s.Row(); row.State != Free || restored != "0" {
		t.Fatalf("%d %q", row.State, restored)
	}
}

// sqlStateErr is a server error with a SQLSTATE, as pgx's *pgconn.PgError.
type sqlStateErr string

func (e sqlStateErr) Error() string    { return "server error " + string(e) }
func (e sqlStateErr) SQLState() string { return string(e) }

// Only the errors of a connection that is gone are a lost connection; a
// ROLLBACK refused on a live one (pgx's "conn busy") is not.
func TestConnLostTellsAGoneConnectionFromARefusal(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{errors.New("conn busy"), false},
		{sqlStateErr("25P02"), false},
		{errors.New("conn closed"), true}, // pgconn.ErrConnClosed
		{fmt.Errorf("rollback: %w", errors.New("conn closed")), true},
		{errors.Join(errors.New("x"), errors.New("conn closed")), true},
		{fmt.Errorf("rollback: %w", sqldriver.ErrBadConn), true},
		{sql.ErrConnDone, true},
		{fmt.Errorf("failed to receive message: %w", io.ErrUnexpectedEOF), true},
		{&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, true},
		{sqlStateErr("57P01"), true}, // a terminated backend
		{sqlStateErr("08006"), true},
	} {
		if got := ConnLost(c.err); got != c.want {
			t.Errorf("ConnLost(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
