package idem_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// RPC answers through the HTTP middleware: gRPC, gRPC-Web and Connect's
// streaming protocol answer 200 whatever the outcome, which they carry in a
// grpc-status trailer, in a trailer frame at the end of the body, or in an
// end-of-stream message. The middleware stores only the answers that say
// success, and replays a stored gRPC answer with its trailers; the others
// are rolled back and passed through as the handler wrote them. (A real
// Connect handler, with grpc-go's and connect's clients, is tested in
// internal/connecttest.)

// frame is one length-prefixed message of the gRPC and Connect envelopes.
func frame(flags byte, payload string) []byte {
	b := make([]byte, 5, 5+len(payload))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], uint32(len(payload)))
	return append(b, payload...)
}

// rpcShapes are the answers the RPC handler writes, by the X-Shape request
// header.
var rpcShapes = map[string]func(w http.ResponseWriter, msg []byte){
	// gRPC as connect-go writes it: trailers with http.TrailerPrefix after
	// the body.
	"grpc-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc+proto")
		w.Header().Set("Grpc-Encoding", "identity")
		_, _ = w.Write(msg)
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
		w.Header().Set(http.TrailerPrefix+"Grpc-Message", "")
		w.Header().Set(http.TrailerPrefix+"X-Ledger-Trailer", "kept")
	},
	"grpc-ok-content-length": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Content-Length", strconv.Itoa(len(msg)))
		_, _ = w.Write(msg)
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
	},
	"grpc-error": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		_, _ = w.Write(msg)
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "13")
		w.Header().Set(http.TrailerPrefix+"Grpc-Message", "ledger down")
	},
	// an error as connect-go's ErrorWriter writes it: the trailers
	// declared, set after WriteHeader, no body.
	"grpc-declared-error": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Trailer", "Grpc-Status,Grpc-Message")
		w.WriteHeader(http.StatusOK)
		w.Header().Set("Grpc-Status", "14")
		w.Header().Set("Grpc-Message", "try later")
	},
	"grpc-declared-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Trailer", "Grpc-Status")
		_, _ = w.Write(msg)
		w.Header().Set("Grpc-Status", "0")
	},
	// a success with no message, status in the headers (a trailers-only
	// answer, as connect-go writes an empty stream without headers of its
	// own); a Content-Length set by the handler too.
	"grpc-trailers-only-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Grpc-Status", "0")
		w.Header().Set("Grpc-Message", "")
		w.WriteHeader(http.StatusOK)
	},
	"grpc-no-status": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		_, _ = w.Write(msg)
	},
	"grpc-two-statuses": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Grpc-Status", "0")
		_, _ = w.Write(msg)
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "13")
	},
	"grpcweb-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web+proto")
		_, _ = w.Write(msg)
		_, _ = w.Write(frame(0x80, "grpc-status: 0\r\ngrpc-message: \r\n"))
	},
	"grpcweb-error": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web+proto")
		_, _ = w.Write(msg)
		_, _ = w.Write(frame(0x80, "grpc-status: 5\r\ngrpc-message: no such account\r\n"))
	},
	"grpcweb-trailers-only": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web+proto")
		w.Header().Set("Grpc-Status", "9")
		w.Header().Set("Grpc-Message", "not now")
	},
	"grpcweb-compressed-trailer": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web")
		_, _ = w.Write(msg)
		_, _ = w.Write(frame(0x81, "grpc-status: 0\r\n"))
	},
	"grpcweb-gzip-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web+proto")
		w.Header().Set("Grpc-Encoding", "gzip")
		_, _ = w.Write(msg)
		var z bytes.Buffer
		zw := gzip.NewWriter(&z)
		_, _ = zw.Write([]byte("grpc-status: 0\r\n"))
		_ = zw.Close()
		_, _ = w.Write(frame(0x81, z.String()))
	},
	"grpcweb-text": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/grpc-web-text")
		_, _ = w.Write([]byte("AAAAAAA="))
	},
	"connect-stream-ok": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/connect+proto")
		_, _ = w.Write(msg)
		_, _ = w.Write(frame(0x02, `{"metadata":{"x":["y"]}}`))
	},
	"connect-stream-error": func(w http.ResponseWriter, msg []byte) {
		w.Header().Set("Content-Type", "application/connect+proto")
		_, _ = w.Write(msg)
		_, _ = w.Write(frame(0x02, `{"error":{"code":"unavailable","message":"later"}}`))
	},
}

// rpcHandler appends a ledger row in the request's transaction and answers
// in the shape X-Shape names, its message frame carrying the row's id.
func (f *fixture) rpcHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := txFrom(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		key, _ := idem.KeyFromContext(r.Context())
		var id int64
		err := tx.QueryRowContext(r.Context(),
			`INSERT INTO `+f.ledger+` (event_id, body) VALUES ($1, '') RETURNING id`, key.EventID).Scan(&id)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		rpcShapes[r.Header.Get("X-Shape")](w, frame(0, fmt.Sprintf("entry %d", id)))
	})
}

type rpcReply struct {
	proto   int
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
}

func rpcCall(t *testing.T, c *http.Client, url, id, shape string) rpcReply {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url+"/ledger.v1.Ledger/Pay", bytes.NewReader(frame(0, "pay 5")))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("X-Event-Id", id)
	req.Header.Set("X-Shape", shape)
	req.Header.Set("Te", "trailers")
	res, err := c.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return rpcReply{proto: res.ProtoMajor, status: res.StatusCode, header: res.Header, trailer: res.Trailer, body: b}
}

// rpcServers serves f's middleware and handler over HTTP/1.1 (f.srv) and
// HTTP/2 (TLS on loopback).
func rpcServers(t *testing.T, f *fixture) map[string]*httptest.Server {
	h2 := httptest.NewUnstartedServer(f.mw.Handler(f.inner))
	h2.EnableHTTP2 = true
	h2.StartTLS()
	t.Cleanup(h2.Close)
	return map[string]*httptest.Server{"HTTP/1.1": f.srv, "HTTP/2": h2}
}

func TestRPCAnswerStoredOnlyOnSuccessWithItsTrailers(t *testing.T) {
	var f *fixture
	f = newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.rpcHandler().ServeHTTP(w, r)
	}))
	servers := rpcServers(t, f)
	for _, proto := range []string{"HTTP/1.1", "HTTP/2"} {
		srv := servers[proto]
		wantProto := map[string]int{"HTTP/1.1": 1, "HTTP/2": 2}[proto]
		t.Run(proto, func(t *testing.T) {
			t.Run("a gRPC success is stored and replayed with its trailers", func(t *testing.T) {
				for _, shape := range []string{"grpc-ok", "grpc-declared-ok"} {
					id := proto + shape
					rows, runs := f.ledgerRows(), f.runs.Load()
					first := rpcCall(t, srv.Client(), srv.URL, id, shape)
					require.Equal(t, wantProto, first.proto)
					require.Equal(t, http.StatusOK, first.status, "%s", first.body)
					assert.Equal(t, "0", first.trailer.Get("Grpc-Status"), shape)
					assert.Empty(t, first.header.Values("Grpc-Status"), "grpc-status goes in the trailers, not the headers")
					retry := rpcCall(t, srv.Client(), srv.URL, id, shape)
					assert.Equal(t, first.body, retry.body, "the same bytes")
					assert.Equal(t, "true", retry.header.Get("Idempotent-Replayed"))
					assert.Equal(t, first.header.Get("Content-Type"), retry.header.Get("Content-Type"))
					assert.Equal(t, first.trailer, retry.trailer, "the same trailers")
					assert.Empty(t, retry.header.Values("Grpc-Status"))
					if shape == "grpc-ok" {
						assert.Equal(t, "kept", retry.trailer.Get("X-Ledger-Trailer"))
						assert.Equal(t, []string{""}, retry.trailer.Values("Grpc-Message"))
						assert.Equal(t, "identity", retry.header.Get("Grpc-Encoding"))
					}
					assert.Equal(t, rows+1, f.ledgerRows(), "one effect")
					assert.Equal(t, runs+1, f.runs.Load(), "the retry did not run the handler")
				}
			})
			t.Run("a trailers-only gRPC success is replayed with its status", func(t *testing.T) {
				id := proto + "grpc-trailers-only-ok"
				rows, runs := f.ledgerRows(), f.runs.Load()
				first := rpcCall(t, srv.Client(), srv.URL, id, "grpc-trailers-only-ok")
				require.Equal(t, http.StatusOK, first.status)
				require.Equal(t, "0", first.header.Get("Grpc-Status"))
				retry := rpcCall(t, srv.Client(), srv.URL, id, "grpc-trailers-only-ok")
				assert.Equal(t, "true", retry.header.Get("Idempotent-Replayed"))
				assert.Equal(t, "0", retry.header.Get("Grpc-Status")+retry.trailer.Get("Grpc-Status"), "the replay carries the status")
				assert.Empty(t, retry.body)
				assert.Equal(t, rows+1, f.ledgerRows(), "one effect")
				assert.Equal(t, runs+1, f.runs.Load(), "the retry did not run the handler")
			})
			t.Run("a handler's Content-Length does not drop the trailers", func(t *testing.T) {
				id := proto + "grpc-ok-cl"
				first := rpcCall(t, srv.Client(), srv.URL, id, "grpc-ok-content-length")
				require.Equal(t, http.StatusOK, first.status)
				assert.Equal(t, "0", first.trailer.Get("Grpc-Status"), "the trailer reached the client")
				retry := rpcCall(t, srv.Client(), srv.URL, id, "grpc-ok-content-length")
				assert.Equal(t, "true", retry.header.Get("Idempotent-Replayed"))
				assert.Equal(t, "0", retry.trailer.Get("Grpc-Status"))
			})
			t.Run("gRPC errors and unreadable statuses pass through, not stored", func(t *testing.T) {
				for shape, status := range map[string]string{
					"grpc-error": "13", "grpc-declared-error": "14", "grpc-no-status": "", "grpc-two-statuses": "13",
				} {
					id := proto + shape
					rows, runs := f.ledgerRows(), f.runs.Load()
					for range 2 {
						r := rpcCall(t, srv.Client(), srv.URL, id, shape)
						require.Equal(t, http.StatusOK, r.status)
						assert.Equal(t, status, r.trailer.Get("Grpc-Status"), "%s: the handler's trailer, as written", shape)
						assert.Empty(t, r.header.Get("Idempotent-Replayed"), shape)
					}
					assert.Equal(t, rows, f.ledgerRows(), "%s: rolled back", shape)
					assert.Equal(t, runs+2, f.runs.Load(), "%s: the retry ran again", shape)
				}
				r := rpcCall(t, srv.Client(), srv.URL, proto+"grpc-error", "grpc-error")
				assert.Equal(t, "ledger down", r.trailer.Get("Grpc-Message"))
				assert.Positive(t, entryOf(t, r.body), "the handler's body, as written")
			})
			t.Run("gRPC-Web and Connect streams are stored only on success", func(t *testing.T) {
				for shape, stored := range map[string]bool{
					"grpcweb-ok": true, "grpcweb-gzip-ok": true, "connect-stream-ok": true,
					"grpcweb-error": false, "grpcweb-trailers-only": false, "grpcweb-compressed-trailer": false,
					"grpcweb-text": false, "connect-stream-error": false,
				} {
					id := proto + shape
					rows, runs := f.ledgerRows(), f.runs.Load()
					first := rpcCall(t, srv.Client(), srv.URL, id, shape)
					retry := rpcCall(t, srv.Client(), srv.URL, id, shape)
					if stored {
						assert.Equal(t, first.body, retry.body, shape)
						assert.Equal(t, "true", retry.header.Get("Idempotent-Replayed"), shape)
						assert.Equal(t, rows+1, f.ledgerRows(), shape)
						assert.Equal(t, runs+1, f.runs.Load(), shape)
						continue
					}
					assert.Empty(t, retry.header.Get("Idempotent-Replayed"), shape)
					assert.Equal(t, rows, f.ledgerRows(), "%s: rolled back", shape)
					assert.Equal(t, runs+2, f.runs.Load(), "%s: the retry ran again", shape)
					if shape == "grpcweb-trailers-only" {
						assert.Equal(t, "9", retry.header.Get("Grpc-Status"))
					}
				}
			})
		})
	}
}

// entryOf reads the ledger id out of an answer's first frame.
func entryOf(t *testing.T, body []byte) int64 {
	t.Helper()
	require.GreaterOrEqual(t, len(body), 5)
	var id int64
	_, err := fmt.Sscanf(string(body[5:]), "entry %d", &id)
	require.NoError(t, err)
	return id
}
