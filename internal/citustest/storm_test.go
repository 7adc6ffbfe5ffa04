package citustest

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestAnyNodeStorm sends concurrent duplicates of each event to two
// middlewares, one connected to the coordinator and one to a worker
// (queries from any node, Citus MX), on both adapters. Advisory locks do
// not meet across nodes; the shard's unique index decides: each event's
// handler commits exactly once, and no delivery is answered 5xx (a unique
// violation at COMMIT would be).
func TestAnyNodeStorm(t *testing.T) {
	t.Parallel()
	c := citus(t, true)
	const (
		events = 30
		copies = 3 // per node
	)
	for _, adapter := range adapters {
		t.Run(adapter, func(t *testing.T) {
			ts := c.newTables(t)
			opts := idem.Options{LockWait: 20 * time.Second}
			hold := func(*http.Request) { time.Sleep(10 * time.Millisecond) } // the handler's work, so deliveries overlap
			handlers := map[string]http.Handler{
				"coordinator": newMiddleware(t, c.coord, adapter, ts, opts).Handler(ledgerHandler(ts, "coordinator", hold)),
				"worker":      newMiddleware(t, c.worker, adapter, ts, opts).Handler(ledgerHandler(ts, "worker", hold)),
			}
			var (
				mu    sync.Mutex
				codes = map[int]int{}
				wg    sync.WaitGroup
			)
			start := make(chan struct{})
			for e := 0; e < events; e++ {
				id := fmt.Sprintf("storm_%d", e)
				for name, h := range handlers {
					for i := 0; i < copies; i++ {
						wg.Add(1)
						go func() {
							defer wg.Done()
							<-start
							r := serve(h, id, `{"storm":true}`)
							mu.Lock()
							codes[r.Code]++
							mu.Unlock()
							if r.Code >= 500 {
								t.Errorf("%s: %s answered %d: %s", name, id, r.Code, r.Body)
							}
						}()
					}
				}
			}
			close(start)
			wg.Wait()
			t.Logf("%s: %d events x %d deliveries from 2 nodes: statuses %v", adapter, events, 2*copies, codes)
			var rows, distinct, maxPer int
			require.NoError(t, c.coord.db.QueryRow(`SELECT count(*), count(DISTINCT event_id), coalesce(max(n), 0)
FROM `+ts.ledger+` JOIN (SELECT event_id, count(*) AS n FROM `+ts.ledger+` GROUP BY event_id) g USING (event_id)`).Scan(&rows, &distinct, &maxPer))
			assert.Equal(t, events, distinct, "every event ran")
			assert.Equal(t, 1, maxPer, "no event ran twice")
			assert.Equal(t, events, rows)
			var completed int
			require.NoError(t, c.coord.db.QueryRow(`SELECT count(*) FROM `+ts.idem+` WHERE completed_at IS NOT NULL AND response_status = 201`).Scan(&completed))
			assert.Equal(t, events, completed)
			assert.Equal(t, events*2*copies, codes[http.StatusCreated]+codes[http.StatusConflict])
		})
	}
}
