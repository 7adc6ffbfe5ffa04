package idemprom_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemprom"
)

func TestMetricsCountRealRequests(t *testing.T) {
	t.Parallel()
	db := openDatabase(t)
	ctx := context.Background()
	require.NoError(t, idem.Migrate(ctx, db, ""))
	_, err := db.ExecContext(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)

	reg := prometheus.NewPedanticRegistry()
	metrics, err := idemprom.New(reg, idemprom.Options{})
	require.NoError(t, err)
	mw, err := idem.New(db, idem.Options{
		KeyFunc:  idem.Header("shop", "X-Event-Id"),
		LockWait: 50 * time.Millisecond,
		Observer: metrics.Observe,
	})
	require.NoError(t, err)

	// The handler writes a ledger row and answers 201; the X-Fail header
	// makes it answer 500 after the write instead, and the event id
	// "evt_slow" makes it wait until released, so that a duplicate finds it
	// in flight.
	entered, release := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idem.Tx(r.Context())
		key, _ := idem.KeyFromContext(r.Context())
		if key.EventID == "evt_slow" {
			close(entered)
			<-release
		}
		var id int64
		if err := tx.QueryRowContext(r.Context(), `INSERT INTO ledger (event_id) VALUES ($1) RETURNING id`, key.EventID).Scan(&id); err != nil {
			http.Error(w, "ledger", http.StatusInternalServerError)
			return
		}
		if r.Header.Get("X-Fail") != "" {
			http.Error(w, "failed after the write", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "ledger row %d\n", id)
	})))
	t.Cleanup(srv.Close)
	post := func(id, body string, header ...string) reply {
		if id != "" {
			header = append(header, "X-Event-Id", id)
		}
		return postTo(t, srv.URL, body, header...)
	}

	first := post("evt_1", `{"n":1}`)
	require.Equal(t, http.StatusCreated, first.Status)
	assertReplay(t, first, post("evt_1", `{"n":1}`))
	assertReplay(t, first, post("evt_1", `{"n":1}`))
	assert.Equal(t, http.StatusUnprocessableEntity, post("evt_1", `{"n":2}`).Status)
	assert.Equal(t, http.StatusBadRequest, post("", `{}`).Status)
	assert.Equal(t, http.StatusInternalServerError, post("evt_2", `{}`, "X-Fail", "1").Status)

	slow := make(chan reply)
	go func() { slow <- post("evt_slow", `{}`) }()
	<-entered
	// The original holds the key until released: the duplicate waits its
	// LockWait out and gets 409.
	assert.Equal(t, http.StatusConflict, post("evt_slow", `{}`).Status)
	close(release)
	assert.Equal(t, http.StatusCreated, (<-slow).Status)

	const want = `
# HELP idem_requests_total Requests handled by the idempotency middleware, by key source, outcome and HTTP status code.
# TYPE idem_requests_total counter
idem_requests_total{code="201",outcome="completed",source="shop"} 2
idem_requests_total{code="201",outcome="replayed",source="shop"} 2
idem_requests_total{code="400",outcome="rejected",source=""} 1
idem_requests_total{code="409",outcome="in_flight",source="shop"} 1
idem_requests_total{code="422",outcome="mismatch",source="shop"} 1
idem_requests_total{code="500",outcome="rolled_back",source="shop"} 1
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_requests_total"))
	assert.Equal(t, map[string]uint64{
		"completed": 2, "replayed": 2, "rejected": 1, "in_flight": 1, "mismatch": 1, "rolled_back": 1,
	}, sampleCounts(t, reg, "idem_request_duration_seconds"))
	assert.Equal(t, map[string]uint64{"in_flight": 1}, sampleCounts(t, reg, "idem_lock_wait_seconds"),
		"only the duplicate that waited is in the wait histogram")

	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	assert.Empty(t, problems, "the metrics follow Prometheus naming conventions")
}

// sampleCounts returns a histogram's observation count per outcome label.
func sampleCounts(t *testing.T, reg prometheus.Gatherer, name string) map[string]uint64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	counts := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" {
					counts[l.GetValue()] = m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return counts
}

func TestSourceLabelFoldsUnboundedSources(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	metrics, err := idemprom.New(reg, idemprom.Options{SourceLabel: func(s string) string {
		provider, _, _ := strings.Cut(s, ":") // "github:1234" -> "github"
		return provider
	}})
	require.NoError(t, err)
	for _, hook := range []string{"github:1", "github:2", "github:3"} {
		metrics.Observe(idem.Observation{Outcome: idem.OutcomeCompleted, Key: idem.Key{Source: hook, EventID: "d"}, Status: 200})
	}
	assert.Equal(t, 1, testutil.CollectAndCount(reg, "idem_requests_total"), "one series for all hooks")
	const want = `
# HELP idem_requests_total Requests handled by the idempotency middleware, by key source, outcome and HTTP status code.
# TYPE idem_requests_total counter
idem_requests_total{code="200",outcome="completed",source="github"} 3
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_requests_total"))
}

func TestNewRegistersAllOrNothing(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	// Someone else already owns one of the names.
	require.NoError(t, reg.Register(prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_lock_wait_seconds", Help: "taken"})))
	_, err := idemprom.New(reg, idemprom.Options{})
	require.Error(t, err)
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		assert.Equal(t, "idem_lock_wait_seconds", f.GetName(), "nothing of the failed New stays registered")
	}

	// Two middlewares in one process: one label apart.
	shared := prometheus.NewRegistry()
	_, err = idemprom.New(prometheus.WrapRegistererWith(prometheus.Labels{"endpoint": "stripe"}, shared), idemprom.Options{})
	require.NoError(t, err)
	_, err = idemprom.New(prometheus.WrapRegistererWith(prometheus.Labels{"endpoint": "github"}, shared), idemprom.Options{})
	require.NoError(t, err)
}
