package idem_test

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Issue 28's findings, each as the attack that showed it.

// HTTP methods are case-sensitive tokens, and a route registered without a
// method receives `post` as well as `POST`: a spelling of a covered method
// is that method, claimed, and its duplicates are replays.
func TestMethodSpellingsOfACoveredMethodAreClaimed(t *testing.T) {
	t.Parallel()
	for name, kf := range map[string]idem.KeyFunc{
		"a preset, scoped by method": idem.Stripe(),
		"a header key":               idem.Header("test", "X-Event-Id"),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			mux := http.NewServeMux()
			f := newFixture(t, idem.Options{KeyFunc: kf}, mux)
			mux.Handle("/webhooks/stripe", f.ledgerHandler()) // no method in the pattern
			const event = `{"id":"evt_method","type":"charge.succeeded"}`
			send := func(method string) reply {
				req, err := http.NewRequest(method, f.srv.URL+"/webhooks/stripe", strings.NewReader(event))
				require.NoError(t, err)
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Event-Id", "evt_method")
				return f.send(req)
			}
			first := send(http.MethodPost)
			require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
			for _, m := range []string{"post", "Post", "pOST"} {
				again := send(m)
				assert.Equal(t, http.StatusCreated, again.status, "%s: %s", m, again.body)
				assert.Equal(t, first.body, again.body, "%s replays the POST's answer", m)
				assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"), m)
			}
			assert.Equal(t, int64(1), f.runs.Load(), "the handler ran once")
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, 1, f.keys())
		})
	}

	// A first delivery spelled `post` is claimed too: the handler has its
	// transaction (idem.Tx reports true), and the key is stored.
	mux := http.NewServeMux()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, mux)
	mux.Handle("/hook", f.ledgerHandler())
	r := f.postTo("post", "/hook", `{"id":"evt_lower"}`)
	require.Equal(t, http.StatusCreated, r.status, "the handler had its transaction: %s", r.body)
	var source string
	require.NoError(t, f.db.QueryRow(`SELECT source FROM "`+f.table+`"`).Scan(&source))
	assert.Equal(t, "stripe POST /hook", source, "the method is upper-cased in the scope")
}

// A client's Content-Length is a claim, not bytes: many connections that
// announce a large body and send a little of it must cost the server memory
// for what they sent, not for what they announced. Not parallel: it
// measures the heap.
func TestStalledBodiesCostWhatTheySentNotWhatTheyAnnounced(t *testing.T) {
	const (
		conns     = 100
		announced = 1 << 20 // MaxBodyBytes: the most a body may announce
		sent      = 4 << 10
	)
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe(), MaxBodyBytes: announced}, nil)
	var arrived sync.WaitGroup // one per connection whose sent bytes the middleware has read
	arrived.Add(conns)
	counting := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = &countingBody{ReadCloser: r.Body, want: sent, reached: arrived.Done}
		f.srv.Config.Handler.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(counting)
	t.Cleanup(srv.Close)

	before := heapInUse()
	head := fmt.Sprintf("POST /webhooks/stripe HTTP/1.1\r\nHost: idem.test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", announced)
	body := append([]byte(`{"id":"evt_stalled","pad":"`), bytes.Repeat([]byte("x"), sent)...)[:sent]
	for range conns {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		_, err = c.Write(append([]byte(head), body...))
		require.NoError(t, err)
	}
	arrived.Wait() // every connection's bytes are in the middleware's buffers
	grown := heapInUse() - before
	t.Logf("heap grew by %.1f MiB for %d connections announcing %d MiB each", float64(grown)/(1<<20), conns, announced>>20)
	assert.Less(t, grown, int64(conns*announced/8), "memory follows the bytes received, not Content-Length")
	assert.Zero(t, f.runs.Load())
}

// countingBody calls reached once its reader has read want bytes.
type countingBody struct {
	io.ReadCloser
	n, want int
	reached func()
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if b.n < b.want && b.n+n >= b.want {
		b.reached()
	}
	b.n += n
	return n, err
}

// heapInUse is the live heap after a collection.
func heapInUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// securityHeaders are what a handler sets to protect the client that reads
// its answer; a replay must carry them as the original did.
var securityHeaders = map[string]string{
	"X-Content-Type-Options":    "nosniff",
	"Content-Security-Policy":   "default-src 'none'",
	"Cache-Control":             "no-store",
	"X-Frame-Options":           "DENY",
	"Referrer-Policy":           "no-referrer",
	"Strict-Transport-Security": "max-age=63072000",
}

func TestReplaysCarryTheOriginalsSecurityHeaders(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for name, v := range securityHeaders {
			w.Header().Set(name, v)
		}
		w.Header().Set("Content-Type", "text/html")
		_, _ = w.Write([]byte("<p>done</p>"))
	}))
	first := f.post("evt_sec", "{}")
	require.Equal(t, http.StatusOK, first.status)
	dup := f.post("evt_sec", "{}")
	require.Equal(t, "true", dup.header.Get("Idempotent-Replayed"))
	for name, v := range securityHeaders {
		assert.Equal(t, v, dup.header.Get(name), "%s is replayed", name)
	}
}

// The default replay headers are a value, not shared state: changing the
// list a caller got (to extend it) changes neither what New reads nor the
// next caller's list.
func TestDefaultReplayHeadersCannotBeChangedFromOutside(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	h := idem.DefaultReplayHeaders()
	require.Equal(t, "Content-Type", h[0])
	h[0] = "Set-Cookie" // New refuses Set-Cookie: it must not see this
	_, err := idem.New(db, idem.Options{KeyFunc: idem.Header("t", "X-Id")})
	require.NoError(t, err)
	assert.Equal(t, "Content-Type", idem.DefaultReplayHeaders()[0])
	assert.NotContains(t, idem.DefaultReplayHeaders(), "Set-Cookie")
}

func TestNewRefusesHopByHopReplayHeaders(t *testing.T) {
	db := idem.OpenTestDB(t)
	for _, h := range []string{"Connection", "Keep-Alive", "Proxy-Connection", "TE", "Trailer", "Transfer-Encoding", "Upgrade", "proxy-authenticate", "Proxy-Authorization"} {
		_, err := idem.New(db, idem.Options{KeyFunc: idem.Header("t", "X-Id"), ReplayHeaders: []string{"ETag", h}})
		if assert.Error(t, err, h) {
			assert.Contains(t, err.Error(), http.CanonicalHeaderKey(h), "the error names the header")
		}
	}
}

// The headers stored with an answer are part of it: a handler that sets
// 20,000 Link values under a small MaxResponseBytes is an answer over the
// cap (rolled back, 500), as one with a body that large is.
func TestStoredHeadersCountTowardMaxResponseBytes(t *testing.T) {
	t.Parallel()
	var f *fixture
	f = newFixture(t, idem.Options{MaxResponseBytes: 64 << 10}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_link', 'x')`)
		require.NoError(t, err)
		for i := range 20_000 {
			w.Header().Add("Link", fmt.Sprintf("</items/%d>; rel=item", i))
		}
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	r := f.post("evt_link", "{}")
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.ErrorIs(t, f.observations()[0].Err, idem.ErrResponseTooLarge)
	assert.Zero(t, len(r.header.Values("Link")), "the over-size answer is not sent")
	assert.Equal(t, 0, f.ledgerRows())
	assert.Equal(t, 0, f.keys())
}
