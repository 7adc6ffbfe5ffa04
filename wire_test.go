package idem_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// wireCounter is a TCP proxy in front of PostgreSQL that counts the round
// trips clients ask for: each Sync message (the end of an extended-protocol
// exchange, pipelined or not) and each simple Query message.
type wireCounter struct {
	ln       net.Listener
	upstream string
	trips    atomic.Int64
	wg       sync.WaitGroup
}

func startWireCounter(t testing.TB) *wireCounter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	w := &wireCounter{ln: ln, upstream: databaseHost(t)}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			w.wg.Add(1)
			go w.serve(c)
		}
	}()
	t.Cleanup(func() { ln.Close(); w.wg.Wait() })
	return w
}

func (w *wireCounter) serve(c net.Conn) {
	defer w.wg.Done()
	defer c.Close()
	up, err := net.Dial("tcp", w.upstream)
	if err != nil {
		return
	}
	defer up.Close()
	go func() { _, _ = io.Copy(c, up); c.Close() }()
	// Client to server: the startup message has no type byte; every later
	// message is a type byte and a length that counts itself.
	var hdr [5]byte
	if _, err := io.ReadFull(c, hdr[:4]); err != nil {
		return
	}
	n := binary.BigEndian.Uint32(hdr[:4])
	rest := make([]byte, n-4)
	if _, err := io.ReadFull(c, rest); err != nil {
		return
	}
	if _, err := up.Write(append(hdr[:4:4], rest...)); err != nil {
		return
	}
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		switch hdr[0] {
		case 'S', 'Q':
			w.trips.Add(1)
		}
		body := make([]byte, binary.BigEndian.Uint32(hdr[1:])-4)
		if _, err := io.ReadFull(c, body); err != nil {
			return
		}
		if _, err := up.Write(append(hdr[:], body...)); err != nil {
			return
		}
	}
}

// TestRoundTripsOnTheWire counts, on the wire, the round trips of each path
// with a pool of one connection, after warm-up (pgx's statement cache
// filled), the fewest of three samples: a new event whose handler runs one statement, a completed
// duplicate's first replay on an instance, a replay from the replay cache,
// and the first replay on an instance of a key answered ten days ago. pgx
// pipelines BEGIN with the claim and the answer with COMMIT.
func TestRoundTripsOnTheWire(t *testing.T) {
	t.Parallel()
	want := map[string][4]int64{
		"database/sql": {5, 4, 0, 4}, // B, claim, ledger, UPDATE, C; B, claim, lookup, R
		"pgx":          {3, 2, 0, 2}, // [B lock read], ledger, [INSERT C]; [B lock read], R
	}
	runs := [][2]string{{"database/sql", ""}, {"pgx", ""}}
	if idem.PartitionedLayout {
		// Without summaries of the past partitions, the claim takes the
		// lock, then reads every partition: one more round trip for a new
		// event on database/sql. With them, a new key's claim is that of a
		// plain table, and a key answered in a past partition is one
		// statement, without a transaction.
		want["database/sql"] = [4]int64{5, 4, 0, 1}
		want["pgx"] = [4]int64{3, 2, 0, 1}
		want["database/sql lock-first"] = [4]int64{6, 4, 0, 4} // B, lock, read, ledger, UPDATE, C; B, lock, read, R
		want["pgx lock-first"] = [4]int64{3, 2, 0, 2}
		runs = append(runs, [2]string{"database/sql", " lock-first"}, [2]string{"pgx", " lock-first"})
	}
	for _, run := range runs {
		adapter, mode := run[0], run[1]
		t.Run(adapter+mode, func(t *testing.T) {
			wc := startWireCounter(t)
			u, err := url.Parse(idem.TestDatabaseURL(t))
			require.NoError(t, err)
			u.Host = wc.ln.Addr().String()
			pool := openPoolURL(t, u.String(), 1)
			f := newFixtureOn(t, pool, idem.Options{}, nil) // tables and checks on f.db, not through the counter
			for i := 0; i < 3; i++ {
				f.insertOld(fmt.Sprintf("warm_old_%d", i), 10*day, true)
				f.insertOld(fmt.Sprintf("evt_old_%d", i), 10*day, true)
			}
			newInstance := func() *idem.Middleware {
				opts := idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: f.table}
				var mw *idem.Middleware
				if adapter == "pgx" {
					mw, err = idempgx.New(pgxPoolFor(t, pool), opts)
				} else {
					mw, err = idem.New(pool, opts)
				}
				require.NoError(t, err)
				if idem.PartitionedLayout {
					s := idem.SummariesOf(mw)
					if mode != "" {
						s.Disable()
					} else {
						s.Set(time.Second, time.Minute, 2*time.Second) // no refresh while counting
						awaitSummaries(t, s)
					}
				}
				return mw
			}
			first, second := newInstance(), newInstance()
			serve := func(mw *idem.Middleware, id string) int64 {
				before := wc.trips.Load()
				r := serveDirect(t, mw.Handler(f.inner), id)
				require.Equal(t, http.StatusCreated, r.Code, "%s", r.Body)
				return wc.trips.Load() - before
			}
			for i := 0; i < 3; i++ { // warm-up: connection, statement caches
				w := fmt.Sprintf("warm_%d", i)
				serve(first, w)
				serve(second, w)
				serve(second, w)
				serve(second, fmt.Sprintf("warm_old_%d", i))
			}
			// Three samples of each path, the fewest counted: a pool pings a
			// connection idle for over a second before reusing it, which a
			// busy machine can cause between two requests.
			got := [4]int64{1 << 30, 1 << 30, 1 << 30, 1 << 30}
			for i := 0; i < 3; i++ {
				id := fmt.Sprintf("evt_%d", i)
				for j, n := range []int64{serve(first, id), serve(second, id), serve(second, id), serve(second, fmt.Sprintf("evt_old_%d", i))} {
					got[j] = min(got[j], n)
				}
			}
			t.Logf("%s%s: new event %d round trips, first replay on an instance %d, cached replay %d, first replay of a key ten days old %d",
				adapter, mode, got[0], got[1], got[2], got[3])
			assert.Equal(t, want[adapter+mode], got)
			assert.Equal(t, 3+3, f.ledgerRows())
		})
	}
}

// serveDirect serves one delivery of id through h, without HTTP.
func serveDirect(t testing.TB, h http.Handler, id string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader("{}"))
	req.Header.Set("X-Event-Id", id)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}
