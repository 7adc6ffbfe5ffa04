package idem_test

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The replay cache answers further duplicates of a key this instance has
// replayed without the database; a second instance that has not replayed the
// key asks the database and gets the same bytes.
func TestReplayCacheServesSeenKeysAndOtherInstancesUseTheDatabase(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	first := f.post("evt_1", `{"a":1}`)
	require.Equal(t, http.StatusCreated, first.status)
	require.Equal(t, first.body, f.post("evt_1", `{"a":1}`).body, "the first replay, from the database")
	assert.False(t, f.observations()[1].Cached)

	// Delete the row behind the cache's back: only memory can answer now.
	_, err := f.db.Exec(`DELETE FROM "` + f.table + `"`)
	require.NoError(t, err)
	dup := f.post("evt_1", `{"a":1}`)
	assert.Equal(t, first.body, dup.body)
	assert.True(t, f.observations()[2].Cached)
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_1", `{"a":2}`).status, "the digest is checked on a hit")

	// Another instance on the same table: its cache is empty, so the
	// (deleted) key is claimed anew there — exactly what a deleted key means.
	g := newFixture(t, idem.Options{}, nil)
	require.Equal(t, http.StatusCreated, g.post("evt_2", `{"b":1}`).status)
	other, err := newMW(t, g.db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: g.table})
	require.NoError(t, err)
	srv := httptest.NewServer(other.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the second instance must replay, not run")
	})))
	defer srv.Close()
	g.srv.Config.Handler = srv.Config.Handler
	r := g.post("evt_2", `{"b":1}`)
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
}

func TestReplayCacheTTLBoundsStaleness(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{ReplayCacheTTL: time.Nanosecond}, nil)
	require.Equal(t, http.StatusCreated, f.post("evt_1", `{}`).status)
	require.Equal(t, "true", f.post("evt_1", `{}`).header.Get("Idempotent-Replayed"), "replayed: now cached")
	_, err := f.db.Exec(`DELETE FROM "` + f.table + `"`)
	require.NoError(t, err)
	r := f.post("evt_1", `{}`)
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Empty(t, r.header.Get("Idempotent-Replayed"), "the expired entry was not used: the deleted key ran again")
	assert.Equal(t, int64(2), f.runs.Load())
}

// New events are not cached: only keys that had a duplicate are.
func TestReplayCacheKeepsOnlyReplayedKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	require.Equal(t, http.StatusCreated, f.post("evt_1", `{}`).status)
	_, err := f.db.Exec(`DELETE FROM "` + f.table + `"`)
	require.NoError(t, err)
	r := f.post("evt_1", `{}`)
	assert.Empty(t, r.header.Get("Idempotent-Replayed"), "nothing was cached for a mere completion: the deleted key ran again")
	assert.Equal(t, int64(2), f.runs.Load())
}
