// Package webhooktest sends deliveries to an example's server and checks
// what the examples' tests all check: a duplicate is answered with the
// original's bytes, marked as a replay.
package webhooktest

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Reply is one answer, read in full.
type Reply struct {
	Status int
	Header http.Header
	Body   []byte
}

// Replayed reports whether the answer came from the idempotency store.
func (r Reply) Replayed() bool { return r.Header.Get("Idempotent-Replayed") == "true" }

// Post sends body to url with the given header name/value pairs and returns
// the answer.
func Post(t testing.TB, url, body string, header ...string) Reply {
	t.Helper()
	return Do(t, http.MethodPost, url, body, header...)
}

// Do sends one request and returns the answer.
func Do(t testing.TB, method, url, body string, header ...string) Reply {
	t.Helper()
	require.Zero(t, len(header)%2, "header names and values come in pairs")
	req, err := http.NewRequestWithContext(context.Background(), method, url, bytes.NewBufferString(body))
	require.NoError(t, err)
	for i := 0; i < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return Reply{Status: res.StatusCode, Header: res.Header, Body: b}
}

// AssertReplay checks that dup is the replay of original: same status, same
// Content-Type, the same body byte for byte, and marked
// Idempotent-Replayed while the original is not.
func AssertReplay(t testing.TB, original, dup Reply) {
	t.Helper()
	assert.False(t, original.Replayed(), "the original is not a replay")
	assert.True(t, dup.Replayed(), "the duplicate carries Idempotent-Replayed: true")
	assert.Equal(t, original.Status, dup.Status)
	assert.Equal(t, original.Header.Get("Content-Type"), dup.Header.Get("Content-Type"))
	assert.Equal(t, string(original.Body), string(dup.Body), "the replay has the original's bytes")
}

// Count runs a query that returns one integer, such as SELECT count(*).
func Count(t testing.TB, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(context.Background(), query, args...).Scan(&n), query)
	return n
}

// Spellings returns path and other ways to write it with percent-escapes
// (lower- and upper-case hex, one character or every one escaped, the
// slashes escaped) that a router decoding the path routes to the same
// handler: an attacker who replays a captured delivery under each must not
// run it again.
func Spellings(path string) []string {
	escape := func(c byte, upper bool) string {
		if upper {
			return fmt.Sprintf("%%%02X", c)
		}
		return fmt.Sprintf("%%%02x", c)
	}
	segs := strings.Split(path, "/")
	out := []string{path}
	for i, s := range segs {
		if s == "" {
			continue
		}
		// The segment's first character escaped, then its last, upper-case.
		first := append([]string(nil), segs...)
		first[i] = escape(s[0], false) + s[1:]
		last := append([]string(nil), segs...)
		last[i] = s[:len(s)-1] + escape(s[len(s)-1], true)
		out = append(out, strings.Join(first, "/"), strings.Join(last, "/"))
	}
	var all, slashes strings.Builder
	for i := 0; i < len(path); i++ {
		if path[i] == '/' {
			all.WriteByte('/')
		} else {
			all.WriteString(escape(path[i], i%2 == 0))
		}
		// Every slash but the first escaped: gorilla/mux decodes %2F
		// before it routes.
		if path[i] == '/' && i > 0 {
			slashes.WriteString(escape('/', i%2 == 0))
		} else {
			slashes.WriteByte(path[i])
		}
	}
	return append(out, all.String(), slashes.String())
}

// PostSpellings posts body, with the header pairs, to every spelling of
// path on base (see Spellings). The first, path as given, must be answered
// 2xx; every other one must be its replay, or not found (a router that
// routes on the path as sent). It returns how many were replays.
func PostSpellings(t testing.TB, base, path, body string, header ...string) (replays int) {
	t.Helper()
	var first Reply
	for i, p := range Spellings(path) {
		r := Post(t, base+p, body, header...)
		switch {
		case i == 0:
			require.True(t, r.Status >= 200 && r.Status < 300, "%s: %d %s", p, r.Status, r.Body)
			first = r
		case r.Status == http.StatusNotFound:
			assert.False(t, r.Replayed(), p)
		default:
			AssertReplay(t, first, r)
			replays++
		}
	}
	return replays
}
