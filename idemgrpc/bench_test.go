package idemgrpc_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// BenchmarkPay: a new key's call of Pay over gRPC on loopback, through
// the interceptor and idem's claim (idem), against two handlers without
// idem: inline, the same claim written by hand in the handler's
// transaction (the key from the metadata, the request's deterministic
// digest, INSERT the key ... ON CONFLICT DO NOTHING, the row, UPDATE the
// key with the marshalled reply, COMMIT: what a service writes when it
// does this itself), and byhand, the row alone in a transaction of its own
// (no deduplication at all); on each adapter; sequential calls, and 8
// clients at once. Each call appends one ledger row. docs/performance.md
// has the figures. Run the compiled test binary in a loop, so that the
// variants take turns:
//
//	go test -c -o /tmp/grpc.test ./idemgrpc
//	for r in 1 2 3 4 5 6; do /tmp/grpc.test -test.run '^$' -test.bench Pay -test.benchtime 2s; done
func BenchmarkPay(b *testing.B) {
	for _, adapter := range adapters {
		for _, variant := range []string{"inline", "byhand", "idem"} {
			for _, clients := range []int{1, 8} {
				name := fmt.Sprintf("%s/%s/clients=%d", pgxOrSQL(adapter), variant, clients)
				b.Run(name, func(b *testing.B) {
					w := newWorld(b, adapter, setup{bare: variant != "idem"})
					switch variant {
					case "byhand":
						w.handle = w.writeByHand
					case "inline":
						w.handle = w.writeInline
					}
					run := fmt.Sprintf("r%d", seq.Add(1))
					// One call before the clock starts: the pool's first
					// connections and the middleware's first claim (which
					// reads the table's layout) are not what is measured.
					if c := w.payKey(req("bench", 1), run+"-warm"); c.err != nil {
						b.Fatal(c.err)
					}
					b.ReportAllocs()
					b.ResetTimer()
					if clients == 1 {
						for i := 0; b.Loop(); i++ {
							if c := w.payKey(req("bench", 1), fmt.Sprintf("%s-%d", run, i)); c.err != nil {
								b.Fatal(c.err)
							}
						}
						return
					}
					b.SetParallelism(clients / 2) // GOMAXPROCS is 2 on the project's machine
					var n int64
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							k := fmt.Sprintf("%s-%d", run, atomicAdd(&n))
							if c := w.payKey(req("bench", 1), k); c.err != nil {
								b.Error(c.err)
								return
							}
						}
					})
				})
			}
		}
	}
}

func pgxOrSQL(adapter string) string {
	if adapter == "pgx" {
		return "pgx"
	}
	return "sql"
}

// writeByHand is write in a transaction of the handler's own: what the
// handler does without idem.
func (w *world) writeByHand(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
	q := `INSERT INTO ` + w.ledger + ` (account, amount) VALUES ($1, $2) RETURNING id`
	var id int64
	if w.pool != nil {
		tx, err := w.pool.Begin(ctx)
		if err != nil {
			return nil, status.Error(codes.Unavailable, "begin failed")
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := tx.QueryRow(ctx, q, r.Account, r.Amount).Scan(&id); err != nil {
			return nil, status.Error(codes.Internal, "write failed")
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, status.Error(codes.Unavailable, "commit failed")
		}
	} else {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, status.Error(codes.Unavailable, "begin failed")
		}
		defer func() { _ = tx.Rollback() }()
		if err := tx.QueryRowContext(ctx, q, r.Account, r.Amount).Scan(&id); err != nil {
			return nil, status.Error(codes.Internal, "write failed")
		}
		if err := tx.Commit(); err != nil {
			return nil, status.Error(codes.Unavailable, "commit failed")
		}
	}
	return &testpb.PayReply{Entry: id, Account: r.Account, Amount: r.Amount, Labels: r.Labels}, nil
}

// writeInline is the claim written by hand in the handler's transaction,
// as a service without idem would write it: the key from the metadata, the
// caller's scope, the request's deterministic digest; BEGIN; INSERT the key
// ... ON CONFLICT DO NOTHING; the row; UPDATE the key with the marshalled
// reply; COMMIT. A key already there answers its stored reply
// (FailedPrecondition for another request's digest, Aborted while it has
// no reply).
func (w *world) writeInline(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
	keys, callers := metadata.ValueFromIncomingContext(ctx, idemgrpc.MetadataKey), metadata.ValueFromIncomingContext(ctx, "tenant")
	if len(keys) != 1 || len(callers) != 1 {
		return nil, status.Error(codes.InvalidArgument, "no key")
	}
	source := testpb.Ledger_Pay_FullMethodName + " " + callers[0]
	in, err := proto.MarshalOptions{Deterministic: true}.Marshal(r)
	if err != nil {
		return nil, status.Error(codes.Internal, "marshal failed")
	}
	digest := sha256.Sum256(in)
	claim, complete := inlineSQL(w.table)
	lookup := `SELECT payload_digest, response_body FROM ` + w.table + ` WHERE source = $1 AND event_id = $2`
	write := `INSERT INTO ` + w.ledger + ` (account, amount) VALUES ($1, $2) RETURNING id`
	var (
		one    int
		id     int64
		stored []byte
		sum    []byte
		out    []byte
	)
	reply := func() *testpb.PayReply {
		return &testpb.PayReply{Entry: id, Account: r.Account, Amount: r.Amount, Labels: r.Labels}
	}
	if w.pool != nil {
		tx, err := w.pool.Begin(ctx)
		if err != nil {
			return nil, status.Error(codes.Unavailable, "begin failed")
		}
		defer func() { _ = tx.Rollback(ctx) }()
		switch err := tx.QueryRow(ctx, claim, source, keys[0], digest[:]).Scan(&one); {
		case errors.Is(err, pgx.ErrNoRows):
			if err := tx.QueryRow(ctx, lookup, source, keys[0]).Scan(&sum, &stored); err != nil {
				return nil, status.Error(codes.Unavailable, "lookup failed")
			}
			return storedReply(sum, digest[:], stored)
		case err != nil:
			return nil, status.Error(codes.Unavailable, "claim failed")
		}
		if err := tx.QueryRow(ctx, write, r.Account, r.Amount).Scan(&id); err != nil {
			return nil, status.Error(codes.Internal, "write failed")
		}
		if out, err = proto.Marshal(reply()); err != nil {
			return nil, status.Error(codes.Internal, "marshal failed")
		}
		if _, err := tx.Exec(ctx, complete, source, keys[0], out); err != nil {
			return nil, status.Error(codes.Unavailable, "store failed")
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, status.Error(codes.Unavailable, "commit failed")
		}
		return reply(), nil
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, status.Error(codes.Unavailable, "begin failed")
	}
	defer func() { _ = tx.Rollback() }()
	switch err := tx.QueryRowContext(ctx, claim, source, keys[0], digest[:]).Scan(&one); {
	case errors.Is(err, sql.ErrNoRows):
		if err := tx.QueryRowContext(ctx, lookup, source, keys[0]).Scan(&sum, &stored); err != nil {
			return nil, status.Error(codes.Unavailable, "lookup failed")
		}
		return storedReply(sum, digest[:], stored)
	case err != nil:
		return nil, status.Error(codes.Unavailable, "claim failed")
	}
	if err := tx.QueryRowContext(ctx, write, r.Account, r.Amount).Scan(&id); err != nil {
		return nil, status.Error(codes.Internal, "write failed")
	}
	if out, err = proto.Marshal(reply()); err != nil {
		return nil, status.Error(codes.Internal, "marshal failed")
	}
	if _, err := tx.ExecContext(ctx, complete, source, keys[0], out); err != nil {
		return nil, status.Error(codes.Unavailable, "store failed")
	}
	if err := tx.Commit(); err != nil {
		return nil, status.Error(codes.Unavailable, "commit failed")
	}
	return reply(), nil
}

// storedReply is the reply a completed key stored, FailedPrecondition for
// a key stored with another request's digest, or Aborted for a key still
// in flight.
func storedReply(stored, digest, reply []byte) (*testpb.PayReply, error) {
	if !bytes.Equal(stored, digest) {
		return nil, status.Error(codes.FailedPrecondition, "another request under this key")
	}
	if reply == nil {
		return nil, status.Error(codes.Aborted, "in flight")
	}
	var rep testpb.PayReply
	if err := proto.Unmarshal(reply, &rep); err != nil {
		return nil, status.Error(codes.Internal, "stored reply unreadable")
	}
	return &rep, nil
}

func atomicAdd(n *int64) int64 { return atomic.AddInt64(n, 1) }

// inlineSQL is the claim and the completion written by hand on table (the
// same statements as the root's benchmarks use; a module's tests import
// only what its users can): an INSERT of the key that does nothing for a
// key already there, and the UPDATE that stores the answer.
func inlineSQL(table string) (claim, complete string) {
	claim = `INSERT INTO ` + table + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING RETURNING 1`
	complete = `UPDATE ` + table + `
SET response_status = 200, response_headers = '{}', response_body = $3, completed_at = now()
WHERE source = $1 AND event_id = $2`
	return claim, complete
}
