package idem_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Hostile requests, sent as raw bytes so that nothing on the client side
// cleans them up, against a server configured as in production (header and
// read timeouts, a header size cap). Each is answered 4xx, by net/http or by
// the middleware; none runs the handler or stores anything; the server goes
// on serving.

// routedKeys picks the KeyFunc by path, so one table serves every preset.
func routedKeys() idem.KeyFunc {
	byPath := map[string]idem.KeyFunc{
		"/json":              idem.JSONField("json", "data.id"),
		"/idempotency-key":   idem.IdempotencyKey("api"),
		"/github":            idem.GitHub(),
		"/standard-webhooks": idem.StandardWebhooks("sw"),
	}
	header := idem.Header("test", "X-Event-Id")
	return func(r *http.Request, body []byte) (idem.Key, error) {
		if kf, ok := byPath[r.URL.Path]; ok {
			return kf(r, body)
		}
		return header(r, body)
	}
}

// rawRequest is a POST written byte for byte.
type rawRequest struct {
	path    string
	headers []string // "Name: value" lines, sent as they are
	body    []byte
	length  int64 // the Content-Length announced, if not len(body)
	chunked bool  // send the body chunked, without a length
	stall   bool  // announce the body, send half of it, then nothing
}

type rawReply struct {
	status int
	header http.Header
	body   []byte
}

// send writes rq on a new connection to addr and reads the answer. The body
// is written while the answer is read, as a client does: a server may answer
// before it has read everything.
func (rq rawRequest) send(t *testing.T, addr string) rawReply {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	// A guard against a hang, not a measurement: every answer comes long
	// before.
	require.NoError(t, conn.SetDeadline(time.Now().Add(30*time.Second)))

	var head bytes.Buffer
	fmt.Fprintf(&head, "POST %s HTTP/1.1\r\nHost: idem.test\r\nConnection: close\r\n", rq.path)
	for _, h := range rq.headers {
		head.WriteString(h + "\r\n")
	}
	body := rq.body
	switch {
	case rq.chunked:
		head.WriteString("Transfer-Encoding: chunked\r\n")
		var chunks bytes.Buffer
		for len(body) > 0 {
			n := min(len(body), 16<<10)
			fmt.Fprintf(&chunks, "%x\r\n%s\r\n", n, body[:n])
			body = body[n:]
		}
		chunks.WriteString("0\r\n\r\n")
		body = chunks.Bytes()
	case rq.length > 0:
		fmt.Fprintf(&head, "Content-Length: %d\r\n", rq.length)
	default:
		fmt.Fprintf(&head, "Content-Length: %d\r\n", len(body))
	}
	if rq.stall {
		body = body[:len(body)/2]
	}
	head.WriteString("\r\n")
	head.Write(body)

	written := make(chan struct{})
	go func() {
		defer close(written)
		_, _ = conn.Write(head.Bytes()) // the server may stop reading: fine
	}()
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	conn.Close()
	<-written
	return rawReply{status: res.StatusCode, header: res.Header, body: b}
}

// productionServer starts a server for h with the limits a production
// server sets; readTimeout bounds reading a whole request.
func productionServer(t *testing.T, h http.Handler, readTimeout time.Duration) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ReadHeaderTimeout = 10 * time.Second
	srv.Config.ReadTimeout = readTimeout
	srv.Config.MaxHeaderBytes = 64 << 10
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

func TestHostileRequestsAre4xxStoreNothingAndTheServerKeepsServing(t *testing.T) {
	t.Parallel()
	const maxBody = 64 << 10
	f := newFixture(t, idem.Options{KeyFunc: routedKeys(), MaxBodyBytes: maxBody}, nil)
	srv := productionServer(t, f.srv.Config.Handler, 10*time.Second)
	// The slow body waits out this server's ReadTimeout.
	slow := productionServer(t, f.srv.Config.Handler, 300*time.Millisecond)

	long := strings.Repeat("k", 10_000)
	deep := func(depth int) []byte {
		return []byte(`{"data": {"id": "evt_deep", "x": ` + strings.Repeat("[", depth) + strings.Repeat("]", depth) + `}}`)
	}
	key := func(v string) []string { return []string{"X-Event-Id: " + v} }
	for _, tc := range []struct {
		name   string
		server *httptest.Server
		rq     rawRequest
		want   int
	}{
		{"a body over MaxBodyBytes, announced", srv,
			rawRequest{path: "/", headers: key("evt_big"), body: bytes.Repeat([]byte("x"), maxBody+1)}, 413},
		{"a body over MaxBodyBytes, chunked", srv,
			rawRequest{path: "/", headers: key("evt_big"), body: bytes.Repeat([]byte("x"), 200<<10), chunked: true}, 413},
		{"a Content-Length far over MaxBodyBytes, body never sent", srv,
			rawRequest{path: "/", headers: key("evt_big"), length: 1 << 40}, 413},
		{"a body that stops coming (the server's ReadTimeout)", slow,
			rawRequest{path: "/", headers: key("evt_slow"), body: []byte(`{"amount": 100}`), stall: true}, 400},
		{"JSON nested 20,000 deep", srv,
			rawRequest{path: "/json", body: deep(20_000)}, 400},
		{"JSON never closed, 7,000 deep", srv,
			rawRequest{path: "/json", body: []byte(strings.Repeat(`{"data":`, 7_000))}, 400},
		{"a header over MaxHeaderBytes", srv,
			rawRequest{path: "/", headers: key(strings.Repeat("h", 128<<10)), body: []byte("{}")}, 431},
		{"a key header of 10,000 characters", srv,
			rawRequest{path: "/", headers: key(long), body: []byte("{}")}, 400},
		{"a JSON id of 10,000 characters", srv,
			rawRequest{path: "/json", body: []byte(`{"data": {"id": "` + long + `"}}`)}, 400},
		{"an Idempotency-Key of 10,000 characters", srv,
			rawRequest{path: "/idempotency-key", headers: []string{`Idempotency-Key: "` + long + `"`}, body: []byte("{}")}, 400},
		{"a GitHub hook id of 10,000 characters", srv,
			rawRequest{path: "/github", headers: []string{"X-GitHub-Delivery: d1", "X-GitHub-Hook-ID: " + long}, body: []byte("{}")}, 400},
		{"invalid UTF-8 in the key header", srv,
			rawRequest{path: "/", headers: key("evt_\xff\xfe"), body: []byte("{}")}, 400},
		{"invalid UTF-8 in the JSON body", srv,
			rawRequest{path: "/json", body: []byte("{\"data\": {\"id\": \"evt_\xc3\x28\"}}")}, 400},
		{"a NUL byte in the key header", srv,
			rawRequest{path: "/", headers: key("evt\x00_1"), body: []byte("{}")}, 400},
		{"a NUL byte escaped in the JSON id", srv,
			rawRequest{path: "/json", body: []byte(`{"data": {"id": "evt\u0000_1"}}`)}, 400},
		{"a raw NUL byte in the JSON body", srv,
			rawRequest{path: "/json", body: []byte("{\"data\": {\"id\": \"evt\x00_1\"}}")}, 400},
		{"terminal escapes in the key", srv,
			rawRequest{path: "/standard-webhooks", headers: []string{"Webhook-Id: evt\x1b[2J"}, body: []byte("{}")}, 400},
		{"C1 control characters in the key", srv,
			rawRequest{path: "/", headers: key("evt\u0085\u009b"), body: []byte("{}")}, 400},
		{"the key header twice", srv,
			rawRequest{path: "/", headers: append(key("evt_a"), key("evt_b")...), body: []byte("{}")}, 400},
		{"the JSON id twice, to be read two ways", srv,
			rawRequest{path: "/json", body: []byte(`{"data": {"id": "evt_a", "id": "evt_b"}}`)}, 400},
		{"the JSON id twice, in two cases encoding/json reads alike", srv,
			rawRequest{path: "/json", body: []byte(`{"data": {"id": "evt_a", "ID": "evt_b"}}`)}, 400},
		{"an Idempotency-Key with text after the string", srv,
			rawRequest{path: "/idempotency-key", headers: []string{`Idempotency-Key: "evt_a" "evt_b"`}, body: []byte("{}")}, 400},
		{"an empty key", srv,
			rawRequest{path: "/", headers: key(""), body: []byte("{}")}, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.rq.send(t, tc.server.Listener.Addr().String())
			assert.Equal(t, tc.want, r.status, "body: %.200s", r.body)
			assert.Less(t, len(r.body), 1024, "nothing of the request is echoed in bulk")
			if r.header.Get("Content-Type") == "application/problem+json" {
				assert.NotContains(t, string(r.body), "kkkkkkkkkk")
				assert.NotContains(t, string(r.body), "evt")
			}
		})
	}
	assert.Zero(t, f.runs.Load(), "the handler never ran")
	assert.Zero(t, f.keys(), "nothing stored")
	assert.Zero(t, f.ledgerRows())
	for _, o := range f.observations() {
		assert.Equal(t, idem.OutcomeRejected, o.Outcome, "%v", o.Err)
	}

	for _, srv := range []*httptest.Server{srv, slow} {
		ok := rawRequest{path: "/json", body: []byte(`{"data": {"id": "evt_fine"}}`)}.send(t, srv.Listener.Addr().String())
		assert.Equal(t, http.StatusCreated, ok.status, "still serving: %s", ok.body)
	}
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 1, f.keys())
}
