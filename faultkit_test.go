package idem_test

import (
	"bytes"
	"database/sql"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/require"
)

// Tools for the fault tests: pools of the test's choosing (for
// newFixtureOn), a TCP proxy that can cut a pool off from PostgreSQL, and a
// sender that never calls t.FailNow (it runs on storm goroutines).

// openPool opens a pool of at most max connections on the test database,
// through the host:port via if via is not "" (a cutProxy).
func openPool(t testing.TB, via string, max int) *sql.DB {
	t.Helper()
	u, err := url.Parse(idem.TestDatabaseURL(t))
	require.NoError(t, err)
	if via != "" {
		u.Host = via
	}
	db, err := idem.OpenDSN(u.String())
	require.NoError(t, err)
	db.SetMaxOpenConns(max)
	t.Cleanup(func() { db.Close() })
	return db
}

// databaseHost is host:port of the server the test database URL names
// (PostgreSQL, or PgBouncer when the suite runs through it).
func databaseHost(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(idem.TestDatabaseURL(t))
	require.NoError(t, err)
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432")
	}
	return u.Host
}

// cutProxy forwards TCP connections from a loopback port to upstream. Cut
// closes every connection through it and drops each new one as soon as it is
// accepted, until Restore: from the pool's side that is PostgreSQL going
// away mid-transaction and refusing to serve while it restarts, without
// touching the shared server.
type cutProxy struct {
	ln       net.Listener
	upstream string
	refused  atomic.Int64 // connections dropped while cut
	wg       sync.WaitGroup

	mu    sync.Mutex
	down  bool
	conns map[net.Conn]struct{}
}

func startProxy(t testing.TB, upstream string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *cutProxy) Addr() string { return p.ln.Addr().String() }

func (p *cutProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		down := p.down
		p.mu.Unlock()
		if down {
			p.refused.Add(1)
			c.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve pipes one client connection to a new upstream connection until
// either side closes or the proxy cuts them.
func (p *cutProxy) serve(c net.Conn) {
	defer p.wg.Done()
	up, err := net.Dial("tcp", p.upstream)
	if err != nil {
		c.Close()
		return
	}
	if !p.track(c, up) {
		c.Close()
		up.Close()
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// track registers a connection pair, unless the proxy went down meanwhile.
func (p *cutProxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		p.refused.Add(1)
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

// Cut closes every open connection and refuses new ones until Restore.
func (p *cutProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		c.Close()
	}
}

// Restore lets connections through again.
func (p *cutProxy) Restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

func (p *cutProxy) close() {
	p.ln.Close()
	p.Cut()
	p.wg.Wait()
}

// sender delivers requests for storm goroutines: errors are returned, never
// reported with t.FailNow.
type sender struct {
	client *http.Client
}

func newSender(t testing.TB) *sender {
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	t.Cleanup(tr.CloseIdleConnections)
	return &sender{client: &http.Client{Transport: tr}}
}

// post delivers body to url with the event id in X-Event-Id.
func (s *sender) post(url, id, body string) (reply, error) {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewBufferString(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("X-Event-Id", id)
	res, err := s.client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return reply{status: res.StatusCode, header: res.Header, body: b}, err
}

// ledgerID reads the ledger row id out of a ledger handler's answer.
func ledgerID(body []byte) (int64, error) {
	var doc struct {
		LedgerID *int64 `json:"ledger_id"`
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		return 0, err
	}
	if doc.LedgerID == nil {
		return 0, errors.New("no ledger_id in the answer")
	}
	return *doc.LedgerID, nil
}

// replies collects every answer each event got, from many goroutines.
type replies struct {
	mu sync.Mutex
	m  map[string][]reply
}

func (rs *replies) add(id string, r reply) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.m == nil {
		rs.m = map[string][]reply{}
	}
	rs.m[id] = append(rs.m[id], r)
}

// checkExactlyOnce asserts what every storm test promises: each of events
// has exactly one ledger row; every 2xx answer of an event carries the same
// status and bytes, and names that row.
func checkExactlyOnce(t *testing.T, f *fixture, events []string, got *replies) {
	t.Helper()
	rows := map[string][]int64{}
	res, err := f.db.Query(`SELECT event_id, id FROM ` + f.ledger)
	require.NoError(t, err)
	defer res.Close()
	for res.Next() {
		var ev string
		var id int64
		require.NoError(t, res.Scan(&ev, &id))
		rows[ev] = append(rows[ev], id)
	}
	require.NoError(t, res.Err())
	got.mu.Lock()
	defer got.mu.Unlock()
	for _, ev := range events {
		require.Len(t, rows[ev], 1, "event %s: exactly one ledger row", ev)
		var first *reply
		for i, r := range got.m[ev] {
			if r.status/100 != 2 {
				continue
			}
			if first == nil {
				first = &got.m[ev][i]
				id, err := ledgerID(r.body)
				require.NoError(t, err, "event %s: %s", ev, r.body)
				require.Equal(t, rows[ev][0], id, "event %s: the 2xx answer names the committed row", ev)
				continue
			}
			require.Equal(t, first.status, r.status, "event %s", ev)
			require.Equal(t, string(first.body), string(r.body), "event %s: every 2xx answer has the same bytes", ev)
		}
		require.NotNil(t, first, "event %s was never answered 2xx", ev)
	}
}
