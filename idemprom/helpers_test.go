package idemprom_test

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// openDatabase creates a database of the test's own on the server at
// DATABASE_URL (default: the local server, postgres@127.0.0.1:5432, trust
// auth), and drops it when the test ends. The test fails when PostgreSQL is
// not there. (A module's tests use only what its users can import: not the
// root module's internal packages.)
func openDatabase(t *testing.T) *sql.DB {
	t.Helper()
	server := os.Getenv("DATABASE_URL")
	if server == "" {
		server = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	u, err := url.Parse(server)
	require.NoError(t, err)
	admin, err := sql.Open("pgx", server)
	require.NoError(t, err)
	t.Cleanup(func() { admin.Close() })
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idemprom_test_" + hex.EncodeToString(b[:])
	_, err = admin.Exec("CREATE DATABASE " + name)
	require.NoError(t, err, "creating a test database through DATABASE_URL=%s (is PostgreSQL running?)", server)
	t.Cleanup(func() {
		_, err := admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)")
		assert.NoError(t, err)
	})
	u.Path = "/" + name
	db, err := sql.Open("pgx", u.String())
	require.NoError(t, err)
	db.SetMaxOpenConns(10)
	t.Cleanup(func() { db.Close() })
	return db
}

// reply is one answer, read in full.
type reply struct {
	Status int
	Header http.Header
	Body   []byte
}

// postTo sends body to url with the given header name/value pairs and
// returns the answer.
func postTo(t *testing.T, url, body string, header ...string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return reply{Status: res.StatusCode, Header: res.Header, Body: b}
}

// assertReplay checks that dup replays original: the same status and bytes,
// marked Idempotent-Replayed while the original is not.
func assertReplay(t *testing.T, original, dup reply) {
	t.Helper()
	assert.Empty(t, original.Header.Get("Idempotent-Replayed"), "the original is not a replay")
	assert.Equal(t, "true", dup.Header.Get("Idempotent-Replayed"))
	assert.Equal(t, original.Status, dup.Status)
	assert.Equal(t, string(original.Body), string(dup.Body), "the replay has the original's bytes")
}
