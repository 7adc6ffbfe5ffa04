package idemotel_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
	"github.com/pgidem/idem/idempgx"
)

// discard is a span exporter that drops what it gets: the cost measured
// is idemotel's and the SDK's, not an exporter's.
type discard struct{}

func (discard) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discard) Shutdown(context.Context) error                             { return nil }

var benchRun atomic.Int64

// BenchmarkNewEvent: every request a key never seen, through the
// middleware alone (observer=none) and with idemotel's Observe and OnPhase
// on a sampling SDK (a batch span processor, a metric reader), the two run
// in turn on each adapter: run it with -count to interleave them. The
// ratio of their ns/op is idemotel's cost on a new event.
func BenchmarkNewEvent(b *testing.B) {
	for _, adapter := range adapters {
		for _, obs := range []string{"none", "idemotel"} {
			b.Run("adapter="+strings.ReplaceAll(adapter, "/", "")+"/observer="+obs, func(b *testing.B) {
				h := benchHandler(b, adapter, obs == "idemotel")
				prefix := fmt.Sprintf("bench-%d-", benchRun.Add(1))
				var seq, bad atomic.Int64
				b.ReportAllocs()
				b.SetParallelism(4)
				b.ResetTimer()
				cpu := cpuTime()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						id := prefix + strconv.FormatInt(seq.Add(1), 10)
						req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"id":"`+id+`"}`))
						req.Header.Set("X-Event-Id", id)
						rec := httptest.NewRecorder()
						h.ServeHTTP(rec, req)
						if rec.Code != http.StatusOK {
							bad.Add(1)
						}
					}
				})
				b.StopTimer()
				b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
				if n := bad.Load(); n > 0 {
					b.Fatalf("%d of %d requests failed", n, b.N)
				}
			})
		}
	}
}

// benchHandler is the middleware around a handler that writes one row in
// its transaction, on a table of its own.
func benchHandler(b *testing.B, adapter string, traced bool) http.Handler {
	b.Helper()
	n := seq.Add(1)
	table, ledger := fmt.Sprintf("bench_keys_%d", n), fmt.Sprintf("bench_ledger_%d", n)
	require.NoError(b, idem.Migrate(context.Background(), db, table))
	_, err := db.Exec(`CREATE TABLE ` + ledger + ` (id bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(b, err)
	opts := idem.Options{Table: table, KeyFunc: idem.Header("bench", "X-Event-Id"),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if traced {
		tel := benchInstrumentation(b)
		opts.Observer, opts.OnPhase = tel.Observe, tel.OnPhase
	}
	var mw *idem.Middleware
	if adapter == "pgx" {
		pool, err := pgxpool.New(context.Background(), dbURL)
		require.NoError(b, err)
		b.Cleanup(pool.Close)
		mw, err = idempgx.New(pool, opts)
		require.NoError(b, err)
	} else {
		mw, err = idem.New(db, opts)
		require.NoError(b, err)
	}
	return mw.Handler(writeLedger(ledger))
}

// benchInstrumentation is idemotel on a sampling SDK: a batch span
// processor (to an exporter that drops the spans) and a metric reader.
func benchInstrumentation(b *testing.B) *idemotel.Instrumentation {
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discard{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	tel, err := idemotel.New(idemotel.WithTracerProvider(tp), idemotel.WithMeterProvider(mp))
	require.NoError(b, err)
	return tel
}

// BenchmarkPerDelivery: idemotel's own work for one new event, without the
// database: the delivery's span and its claim, handler and COMMIT phases
// (OnPhase's four starts and ends), then Observe, as the middleware calls
// them, on a sampling SDK with a batch span processor and a metric reader.
// It is the CPU time and the allocations idemotel adds to each new event,
// measured apart from PostgreSQL's noise; BenchmarkNewEvent measures the
// same end to end.
func BenchmarkPerDelivery(b *testing.B) {
	tel := benchInstrumentation(b)
	key := idem.Key{Source: "stripe POST /webhooks/stripe", EventID: "evt_1"}
	parent := context.Background()
	b.ReportAllocs()
	cpu := cpuTime()
	for b.Loop() {
		ctx, endDelivery := tel.OnPhase(parent, idem.PhaseDelivery, key)
		for _, p := range []idem.Phase{idem.PhaseClaim, idem.PhaseHandler, idem.PhaseCommit} {
			_, end := tel.OnPhase(ctx, p, key)
			end(nil)
		}
		tel.Observe(idem.Observation{Outcome: idem.OutcomeCompleted, Key: key, Method: http.MethodPost,
			Status: http.StatusOK, Duration: time.Millisecond, Context: ctx})
		endDelivery(nil)
	}
	b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
}

// cpuTime is the CPU time this process has used (user and system), which a
// loaded machine's other processes do not inflate as they do wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
