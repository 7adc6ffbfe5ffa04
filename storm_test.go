package idem_test

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A provider's retry storm: every event delivered several times at once.
// Whatever the interleaving, each event has exactly one ledger row, and every
// 2xx answer for an event carries the same bytes.
func TestRetryStormRunsEachEventOnce(t *testing.T) {
	t.Parallel()
	const events, deliveries = 50, 8
	f := newFixture(t, idem.Options{LockWait: 10 * time.Second}, nil)

	type result struct {
		event  int
		status int
		body   []byte
		replay bool
	}
	results := make(chan result, events*deliveries)
	start := make(chan struct{})
	var wg sync.WaitGroup
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: events * deliveries}}
	defer client.CloseIdleConnections()
	for e := 0; e < events; e++ {
		for d := 0; d < deliveries; d++ {
			wg.Add(1)
			go func(e int) {
				defer wg.Done()
				<-start
				body := fmt.Sprintf(`{"order": %d}`, e)
				req, err := http.NewRequest(http.MethodPost, f.srv.URL, strings.NewReader(body))
				if !assert.NoError(t, err) {
					return
				}
				req.Header.Set("X-Event-Id", fmt.Sprintf("evt_%d", e))
				res, err := client.Do(req)
				if !assert.NoError(t, err) {
					return
				}
				var buf bytes.Buffer
				_, err = buf.ReadFrom(res.Body)
				res.Body.Close()
				assert.NoError(t, err)
				results <- result{e, res.StatusCode, buf.Bytes(), res.Header.Get("Idempotent-Replayed") == "true"}
			}(e)
		}
	}
	close(start)
	wg.Wait()
	close(results)

	first := map[int][]byte{}
	statuses := map[int]int{}
	originals := map[int]int{}
	for r := range results {
		statuses[r.status]++
		if r.status != http.StatusCreated {
			assert.Equal(t, http.StatusConflict, r.status, "only replays, originals and in-flight 409s")
			continue
		}
		if !r.replay {
			originals[r.event]++
		}
		if prev, ok := first[r.event]; ok {
			assert.Equal(t, prev, r.body, "event %d: every 2xx carries the same bytes", r.event)
		} else {
			first[r.event] = r.body
		}
	}
	t.Logf("statuses: %v", statuses)
	assert.Len(t, first, events, "every event was answered 2xx at least once")
	for e := 0; e < events; e++ {
		assert.Equal(t, 1, originals[e], "event %d ran once", e)
	}
	assert.Equal(t, events, f.ledgerRows(), "one side effect per event")
	assert.Equal(t, int64(events), f.runs.Load())
	var perEvent int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM (SELECT event_id FROM `+f.ledger+
		` GROUP BY event_id HAVING count(*) > 1) d`).Scan(&perEvent))
	assert.Zero(t, perEvent, "no event has two ledger rows")
}
