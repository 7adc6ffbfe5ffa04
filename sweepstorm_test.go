package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSweepDuringStormDeletesNoLiveKey sweeps, again and again, while a
// storm of new events, duplicates and redeliveries of expired keys runs,
// and while claims are in flight whose claimed_at says they expired long
// ago. Only the keys that were expired and committed before are deleted;
// every fresh event runs exactly once, and every claim in flight commits.
func TestSweepDuringStormDeletesNoLiveKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const (
		expired  = 20_000 // committed 40 days ago, past the 30 days' retention
		events   = 40     // fresh events, delivered copies times each
		copies   = 3
		inflight = 3 // claims held open, backdated by 60 days, through the sweeps
	)
	entered, release := make(chan struct{}, inflight), make(chan struct{})
	var f *fixture
	f = newPlainFixture(t, idem.Options{LockWait: 200 * time.Millisecond, HandlerTimeout: 5 * time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			k, _ := idem.KeyFromContext(r.Context())
			var n int
			if _, err := fmt.Sscanf(k.EventID, "inflight_%d", &n); err == nil {
				tx, _ := txFrom(r.Context())
				_, err := tx.ExecContext(r.Context(), `UPDATE "`+f.table+`" SET claimed_at = now() - interval '60 days'
					WHERE source = $1 AND event_id = $2`, k.Source, k.EventID)
				assert.NoError(t, err)
				entered <- struct{}{}
				<-release
			}
			f.ledgerHandler().ServeHTTP(w, r)
		}))
	insertKeys(t, f.db, f.table, "old_", expired, 40*day) // sweep_test.go

	held := make([]string, inflight)
	heldReplies := make(chan reply, inflight)
	for i := range held {
		held[i] = fmt.Sprintf("inflight_%d", i)
		go func(id string) { heldReplies <- f.post(id, "{}") }(held[i])
		<-entered
	}

	// The sweeper: one Sweep after another, in small batches, until told
	// to stop.
	var sweeps, removed atomic.Int64
	stop, swept := make(chan struct{}), make(chan error, 1)
	go func() {
		for {
			res, err := idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, BatchSize: 200, MaxBatches: 1000, Pause: -1})
			removed.Add(res.Removed)
			if err != nil {
				swept <- err
				return
			}
			sweeps.Add(1)
			select {
			case <-stop:
				swept <- nil
				return
			default:
			}
		}
	}()
	// The storm starts once deletes are under way.
	waitFor(t, "the first sweep batch", func() bool { return removed.Load() > 0 || countKeys(t, f.db, f.table, "old_") < expired })

	leftAtStart := countKeys(t, f.db, f.table, "old_")
	s := newSender(t)
	var got replies
	ids := make([]string, events)
	var wg sync.WaitGroup
	deliver := func(id string, retry bool) {
		defer wg.Done()
		for try := 0; try < 50; try++ {
			r, err := s.post(f.srv.URL, id, "{}")
			if !assert.NoError(t, err) {
				return
			}
			got.add(id, r)
			if !retry || r.status != http.StatusConflict {
				return
			}
		}
	}
	for e := range ids {
		ids[e] = fmt.Sprintf("fresh_%d", e)
		for c := 0; c < copies; c++ {
			wg.Add(1)
			go deliver(ids[e], true)
		}
		// Redeliveries of expired keys: replayed if not swept yet, run
		// anew if swept; a duplicate of a claim in flight: 409.
		wg.Add(2)
		go deliver(fmt.Sprintf("old_%d", 1+e*(expired/events)), true)
		go deliver(held[e%inflight], false)
	}
	wg.Wait()
	t.Logf("expired keys left when the storm began: %d, when it ended: %d", leftAtStart, countKeys(t, f.db, f.table, "old_"))
	// One whole sweep more after the storm, the claims still in flight.
	after := sweeps.Load()
	waitFor(t, "a sweep after the storm", func() bool { return sweeps.Load() >= after+2 })
	close(stop)
	require.NoError(t, <-swept)

	// Only now may the claims in flight commit (backdated as they are, the
	// next sweep would take them).
	close(release)
	statuses := map[int]int{}
	for range held {
		r := <-heldReplies
		statuses[r.status]++
		key, err := ledgerID(r.body)
		if assert.NoError(t, err, "%s", r.body) {
			var ev string
			require.NoError(t, f.db.QueryRow(`SELECT event_id FROM `+f.ledger+` WHERE id = $1`, key).Scan(&ev))
			got.add(ev, r)
		}
	}
	assert.Equal(t, map[int]int{http.StatusCreated: inflight}, statuses, "no claim in flight was deleted under its handler")
	checkExactlyOnce(t, f, append(ids, held...), &got)
	for _, id := range append(ids, held...) {
		assert.True(t, keyStored(t, f, id), "%s: its key outlived every sweep", id)
	}
	assert.Equal(t, int64(expired), removed.Load(), "each expired key deleted once, nothing else")
	got.mu.Lock()
	defer got.mu.Unlock()
	for id, rs := range got.m {
		for _, r := range rs {
			switch {
			case id[:3] == "old":
				assert.Contains(t, []int{http.StatusOK, http.StatusCreated}, r.status, "%s: replayed, or run anew once swept", id)
			case id[:3] == "inf":
				// 409 for the duplicates sent while it was in flight; the
				// original's own 201 is checked above.
				assert.Contains(t, []int{http.StatusConflict, http.StatusCreated}, r.status, "%s", id)
			}
		}
	}
	t.Logf("%d sweeps removed %d keys during the storm", sweeps.Load(), removed.Load())
}

// keyStored reports whether the key (test, id) is committed.
func keyStored(t *testing.T, f *fixture, id string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, f.db.QueryRow(`SELECT EXISTS (SELECT 1 FROM "`+f.table+`" WHERE source = 'test' AND event_id = $1)`, id).Scan(&ok))
	return ok
}
