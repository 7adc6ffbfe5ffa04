package idemotel_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
)

// spanSet is the spans a test saw end.
type spanSet []sdktrace.ReadOnlySpan

// named returns the spans called name.
func (s spanSet) named(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, sp := range s {
		if sp.Name() == name {
			out = append(out, sp)
		}
	}
	return out
}

// one returns the only span called name, failing the test otherwise.
func (s spanSet) one(t testing.TB, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	got := s.named(name)
	require.Len(t, got, 1, "spans named %q among %v", name, s.names())
	return got[0]
}

// server returns the only server span (otelhttp's).
func (s spanSet) server(t testing.TB) sdktrace.ReadOnlySpan {
	t.Helper()
	var out []sdktrace.ReadOnlySpan
	for _, sp := range s {
		if sp.SpanKind() == trace.SpanKindServer {
			out = append(out, sp)
		}
	}
	require.Len(t, out, 1, "server spans among %v", s.names())
	return out[0]
}

func (s spanSet) names() []string {
	var out []string
	for _, sp := range s {
		out = append(out, sp.Name())
	}
	return out
}

// children returns the names of parent's children, in order of start.
func (s spanSet) children(parent sdktrace.ReadOnlySpan) []string {
	var kids []sdktrace.ReadOnlySpan
	for _, sp := range s {
		if sp.Parent().SpanID() == parent.SpanContext().SpanID() {
			kids = append(kids, sp)
		}
	}
	sort.Slice(kids, func(i, j int) bool { return kids[i].StartTime().Before(kids[j].StartTime()) })
	var out []string
	for _, k := range kids {
		out = append(out, k.Name())
	}
	return out
}

// attrs returns a span's attributes as a map.
func attrs(sp sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range sp.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// within asserts that child ran inside parent, by their real times.
func within(t testing.TB, parent, child sdktrace.ReadOnlySpan) {
	t.Helper()
	assert.False(t, child.StartTime().Before(parent.StartTime()), "%s starts before %s", child.Name(), parent.Name())
	assert.False(t, child.EndTime().After(parent.EndTime()), "%s ends after %s", child.Name(), parent.Name())
	assert.Equal(t, parent.SpanContext().SpanID(), child.Parent().SpanID(), "%s's parent", child.Name())
}

// withoutSQL drops otelpgx's spans from names (their number is pgx's
// business).
func withoutSQL(names []string) []string {
	var out []string
	for _, n := range names {
		if strings.HasPrefix(n, "idem") {
			out = append(out, n)
		}
	}
	return out
}

// sqlUnder counts the SQL spans (otelpgx's) under parent.
func (s spanSet) sqlUnder(parent sdktrace.ReadOnlySpan) int {
	n := 0
	for _, name := range s.children(parent) {
		if !strings.HasPrefix(name, "idem") {
			n++
		}
	}
	return n
}

func TestSpansOfANewEventAndItsReplays(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		require.Equal(t, http.StatusOK, w.post("evt_1", `{"a":1}`))

		s := w.ended()
		server := s.server(t)
		delivery := s.one(t, "idem test")
		assert.Equal(t, server.SpanContext().SpanID(), delivery.Parent().SpanID(), "idem's span is a child of otelhttp's")
		assert.Equal(t, server.SpanContext().TraceID(), delivery.SpanContext().TraceID())
		assert.Equal(t, []string{"idem.claim", "idem.handler", "idem.commit"}, withoutSQL(s.children(delivery)))
		claim, handler, commit := s.one(t, "idem.claim"), s.one(t, "idem.handler"), s.one(t, "idem.commit")
		for _, sp := range []sdktrace.ReadOnlySpan{claim, handler, commit} {
			within(t, delivery, sp)
			assert.Equal(t, codes.Unset, sp.Status().Code)
		}
		assert.False(t, handler.StartTime().Before(claim.EndTime()), "the handler runs after the claim")
		assert.False(t, commit.StartTime().Before(handler.EndTime()), "the COMMIT after the handler")
		a := attrs(delivery)
		assert.Equal(t, "completed", a[idemotel.AttrOutcome].AsString())
		assert.Equal(t, "test", a[idemotel.AttrSource].AsString())
		assert.False(t, a[idemotel.AttrTookOver].AsBool())
		assert.False(t, a[idemotel.AttrCached].AsBool())
		assert.NotContains(t, a, idemotel.AttrEventID, "the event id is recorded only when allowed")
		assert.NotContains(t, a, idemotel.AttrWaited)
		assert.Equal(t, codes.Unset, delivery.Status().Code)
		if adapter == "pgx" {
			assert.Positive(t, s.sqlUnder(claim), "the claim's SQL nests under idem.claim")
			assert.Positive(t, s.sqlUnder(handler), "the handler's INSERT nests under idem.handler")
			assert.Positive(t, s.sqlUnder(commit), "the COMMIT nests under idem.commit")
			assert.Zero(t, s.sqlUnder(server), "no SQL outside idem's spans")
		}

		t.Run("a replay from the database: the claim only", func(t *testing.T) {
			require.Equal(t, http.StatusOK, w.post("evt_1", `{"a":1}`))
			s := w.ended()
			delivery := s.one(t, "idem test")
			assert.Equal(t, []string{"idem.claim"}, withoutSQL(s.children(delivery)))
			a := attrs(delivery)
			assert.Equal(t, "replayed", a[idemotel.AttrOutcome].AsString())
			assert.False(t, a[idemotel.AttrCached].AsBool())
		})
		t.Run("a replay from memory: no phase, cached", func(t *testing.T) {
			require.Equal(t, http.StatusOK, w.post("evt_1", `{"a":1}`))
			s := w.ended()
			delivery := s.one(t, "idem test")
			assert.Empty(t, s.children(delivery))
			a := attrs(delivery)
			assert.Equal(t, "replayed", a[idemotel.AttrOutcome].AsString())
			assert.True(t, a[idemotel.AttrCached].AsBool())
		})
		t.Run("a 422: another body for the key", func(t *testing.T) {
			require.Equal(t, http.StatusUnprocessableEntity, w.post("evt_1", `{"a":2}`))
			s := w.ended()
			delivery := s.one(t, "idem test")
			a := attrs(delivery)
			assert.Equal(t, "mismatch", a[idemotel.AttrOutcome].AsString())
			assert.Equal(t, codes.Unset, delivery.Status().Code, "a 422 is an answer, not a failure")
		})
		assert.Equal(t, 1, w.ledgerRows())

		rm := w.metrics()
		assert.Equal(t, map[string]int64{"completed": 1, "replayed": 2, "mismatch": 1}, requestsByOutcome(t, rm, "test"))
		assert.Equal(t, int64(1), sumOf(t, rm, "idem.replay_cache.hits"))
		assert.Equal(t, int64(1), gauge(t, rm, "idem.replay_cache.entries"))
		assert.Positive(t, gauge(t, rm, "idem.replay_cache.size"))
		assert.Equal(t, int64(0), gauge(t, rm, "idem.waiting.connections"))
		for _, p := range []string{"claim", "handler", "commit"} {
			assert.Positive(t, histCount(t, rm, "idem."+p+".duration"), p)
		}
		assert.Equal(t, map[string]int{"completed": 1, "replayed": 2, "mismatch": 1}, httpDurationByOutcome(t, rm),
			"otelhttp's http.server.request.duration carries idem.outcome")
	})
}

func TestSpanOfADuplicateAnswered409AfterWaiting(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{opts: idem.Options{LockWait: 300 * time.Millisecond}})
		entered, open := w.holdFirst()
		orig := w.postAsync("evt_w", `{}`)
		<-entered
		require.Equal(t, http.StatusConflict, w.post("evt_w", `{}`))
		open()
		require.Equal(t, http.StatusOK, <-orig)

		var dup sdktrace.ReadOnlySpan
		s := w.ended()
		for _, sp := range s.named("idem test") {
			if attrs(sp)[idemotel.AttrOutcome].AsString() == "in_flight" {
				dup = sp
			}
		}
		require.NotNil(t, dup, "the duplicate's span")
		a := attrs(dup)
		assert.Positive(t, a[idemotel.AttrWaited].AsFloat64())
		assert.Equal(t, codes.Unset, dup.Status().Code, "a 409 is an answer, not a failure")
		assert.Equal(t, []string{"idem.wait"}, s.children(dup), "it waited in memory for the original on this instance")
		var wait sdktrace.ReadOnlySpan
		for _, sp := range s.named("idem.wait") {
			if sp.Parent().SpanID() == dup.SpanContext().SpanID() {
				wait = sp
			}
		}
		within(t, dup, wait)
		assert.GreaterOrEqual(t, wait.EndTime().Sub(wait.StartTime()), 250*time.Millisecond, "the wait's span lasts the wait")
		assert.Equal(t, int64(1), histCount(t, w.metrics(), "idem.wait.duration"))
	})
}

// A duplicate on another instance waits in PostgreSQL, holding a
// connection (the gauge says so while it waits), inside its claim; then it
// replays the original's answer.
func TestSpanOfADuplicateWaitingInPostgreSQL(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		entered, open := w.holdFirst()
		orig := w.postAsync("evt_pg", `{}`)
		<-entered
		mw2, other := w.another()
		reg, err := w.tel.Watch(mw2, attribute.String("instance", "other"))
		require.NoError(t, err)
		t.Cleanup(func() { _ = reg.Unregister() })
		dup := make(chan int, 1)
		go func() { dup <- w.postTo(other, "evt_pg", `{}`) }()
		deadline := time.Now().Add(10 * time.Second) // no event says "waiting": poll
		for mw2.Stats().WaitingInPostgres != 1 {
			require.True(t, time.Now().Before(deadline), "the duplicate never waited in PostgreSQL")
			time.Sleep(5 * time.Millisecond)
		}
		assert.Equal(t, int64(1), gauge(t, w.metrics(), "idem.waiting.connections"))
		open()
		require.Equal(t, http.StatusOK, <-orig)
		require.Equal(t, http.StatusOK, <-dup)
		assert.Equal(t, int64(0), gauge(t, w.metrics(), "idem.waiting.connections"))

		s := w.ended()
		var replayed sdktrace.ReadOnlySpan
		for _, sp := range s.named("idem test") {
			if attrs(sp)[idemotel.AttrOutcome].AsString() == "replayed" {
				replayed = sp
			}
		}
		require.NotNil(t, replayed)
		assert.Positive(t, attrs(replayed)[idemotel.AttrWaited].AsFloat64())
		assert.Equal(t, []string{"idem.claim"}, withoutSQL(s.children(replayed)))
		for _, claim := range s.named("idem.claim") {
			if claim.Parent().SpanID() == replayed.SpanContext().SpanID() {
				assert.Equal(t, []string{"idem.wait"}, withoutSQL(s.children(claim)), "the wait in PostgreSQL is inside the claim")
				if adapter == "pgx" {
					wait := s.one(t, "idem.wait")
					assert.Positive(t, s.sqlUnder(wait), "the waiting statement nests under idem.wait")
				}
			}
		}
	})
}

// A lease-mode original that outlives its lease is taken over by a
// redelivery (took_over), and is then fenced: its answer is not stored.
func TestSpansOfATakeoverAndTheFencedOriginal(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{opts: idem.Options{Lease: 200 * time.Millisecond, HandlerTimeout: 20 * time.Second}})
		entered, open := w.holdFirst()
		orig := w.postAsync("evt_l", `{}`)
		<-entered
		w.leaseOver("evt_l")
		_, other := w.another()
		require.Equal(t, http.StatusOK, w.postTo(other, "evt_l", `{}`), "a redelivery to another instance takes the key over")
		open()
		require.Equal(t, http.StatusConflict, <-orig, "the original is fenced")
		assert.Equal(t, 1, w.ledgerRows())

		byOutcome := map[string]sdktrace.ReadOnlySpan{}
		s := w.ended()
		for _, sp := range s.named("idem test") {
			byOutcome[attrs(sp)[idemotel.AttrOutcome].AsString()] = sp
		}
		require.Contains(t, byOutcome, "completed")
		require.Contains(t, byOutcome, "fenced")
		assert.True(t, attrs(byOutcome["completed"])[idemotel.AttrTookOver].AsBool())
		fenced := byOutcome["fenced"]
		assert.False(t, attrs(fenced)[idemotel.AttrTookOver].AsBool())
		assert.Equal(t, codes.Error, fenced.Status().Code)
		assert.Equal(t, "fenced", attrs(fenced)["error.type"].AsString())
		assert.Empty(t, fenced.Events(), "errors set the status, they are not recorded as events")
		var commit sdktrace.ReadOnlySpan
		for _, sp := range s.named("idem.commit") {
			if sp.Parent().SpanID() == fenced.SpanContext().SpanID() {
				commit = sp
			}
		}
		require.NotNil(t, commit, "the fenced original's COMMIT span")
		assert.Equal(t, codes.Error, commit.Status().Code)
		assert.Equal(t, "lease_expired", attrs(commit)["error.type"].AsString())
	})
}

// 50 events, each delivered 4 times at once: 50 completed, and the other
// 150 replayed or answered 409, as the counter says.
func TestMetricsAfterAStorm(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		var wg sync.WaitGroup
		statuses := make(chan int, 200)
		// Each event's four deliveries at once, at most 32 requests in
		// flight: 200 at once on each adapter (with the other suites on two
		// cores) once ran past the pool's wait and answered 503.
		slots := make(chan struct{}, 32)
		for e := range 50 {
			for range 4 {
				slots <- struct{}{}
				wg.Go(func() {
					defer func() { <-slots }()
					statuses <- w.post(fmt.Sprintf("storm_%d", e), `{}`)
				})
			}
		}
		wg.Wait()
		close(statuses)
		for st := range statuses {
			require.Contains(t, []int{http.StatusOK, http.StatusConflict}, st)
		}
		assert.Equal(t, 50, w.ledgerRows())
		got := requestsByOutcome(t, w.metrics(), "test")
		assert.Equal(t, int64(50), got["completed"])
		assert.Equal(t, int64(150), got["replayed"]+got["in_flight"], "%v", got)
		assert.Equal(t, int64(200), got["completed"]+got["replayed"]+got["in_flight"], "%v", got)
		assert.Len(t, w.ended().named("idem test"), 200)
	})
}

// Without OnPhase, and for a request rejected before its key is known, the
// span is made from the Observation, with its start.
func TestObserveAloneMakesTheSpanAfterTheFact(t *testing.T) {
	w := newWorld(t, "database/sql", setup{noPhases: true})
	before := time.Now()
	require.Equal(t, http.StatusOK, w.post("evt_a", `{}`))
	require.Equal(t, http.StatusBadRequest, w.post("", `{}`))
	s := w.ended()
	delivery := s.one(t, "idem test")
	assert.Empty(t, s.children(delivery))
	assert.False(t, delivery.StartTime().Before(before))
	assert.Equal(t, "completed", attrs(delivery)[idemotel.AttrOutcome].AsString())
	rejected := s.one(t, "idem")
	assert.Equal(t, "rejected", attrs(rejected)[idemotel.AttrOutcome].AsString())
	servers := map[trace.SpanID]bool{}
	for _, sp := range s {
		if sp.SpanKind() == trace.SpanKindServer {
			servers[sp.SpanContext().SpanID()] = true
		}
	}
	for _, sp := range []sdktrace.ReadOnlySpan{delivery, rejected} {
		assert.True(t, servers[sp.Parent().SpanID()], "a child of otelhttp's span")
	}
	assert.Equal(t, map[string]int64{"completed": 1}, requestsByOutcome(t, w.metrics(), "test"))
	assert.Equal(t, map[string]int64{"rejected": 1}, requestsByOutcome(t, w.metrics(), ""))
}

// A call of Do is a child of the caller's span; fn's error fails the
// handler's span and the delivery's (rolled back).
func TestSpansOfDo(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		ctx, parent := w.tp.Tracer("consumer").Start(context.Background(), "message")
		key := idem.Key{Source: "orders", EventID: "m1"}
		_, err := w.mw.Do(ctx, key, []byte("p"), func(context.Context) ([]byte, error) { return nil, errors.New("boom") })
		require.Error(t, err)
		res, err := w.mw.Do(ctx, key, []byte("p"), func(context.Context) ([]byte, error) { return []byte("done"), nil })
		require.NoError(t, err)
		assert.Equal(t, "done", string(res.Value))
		parent.End()

		s := w.ended()
		deliveries := s.named("idem orders")
		require.Len(t, deliveries, 2)
		for _, d := range deliveries {
			assert.Equal(t, parent.SpanContext().SpanID(), d.Parent().SpanID())
		}
		failed, done := deliveries[0], deliveries[1]
		assert.Equal(t, "rolled_back", attrs(failed)[idemotel.AttrOutcome].AsString())
		assert.Equal(t, codes.Error, failed.Status().Code)
		assert.Equal(t, "rolled_back", attrs(failed)["error.type"].AsString())
		assert.Equal(t, []string{"idem.claim", "idem.handler"}, withoutSQL(s.children(failed)))
		for _, h := range s.named("idem.handler") {
			if h.Parent().SpanID() == failed.SpanContext().SpanID() {
				assert.Equal(t, codes.Error, h.Status().Code)
				assert.Equal(t, "_OTHER", attrs(h)["error.type"].AsString())
			}
		}
		assert.Equal(t, "completed", attrs(done)[idemotel.AttrOutcome].AsString())
		assert.Equal(t, []string{"idem.claim", "idem.handler", "idem.commit"}, withoutSQL(s.children(done)))
	})
}

// WithEventID records the event id; WithSourceAttribute maps the metrics'
// source and leaves the spans' alone.
func TestOptions(t *testing.T) {
	w := newWorld(t, "database/sql", setup{tel: []idemotel.Option{
		idemotel.WithEventID(),
		idemotel.WithSourceAttribute(func(string) string { return "" }),
	}})
	require.Equal(t, http.StatusOK, w.post("evt_o", `{}`))
	delivery := w.ended().one(t, "idem test")
	assert.Equal(t, "evt_o", attrs(delivery)[idemotel.AttrEventID].AsString())
	assert.Equal(t, "test", attrs(delivery)[idemotel.AttrSource].AsString())
	rm := w.metrics()
	assert.Equal(t, map[string]int64{"completed": 1}, requestsByOutcome(t, rm, ""), "the source is left out")
}

// requestsByOutcome sums idem.requests by outcome for source ("" for points
// without a source).
func requestsByOutcome(t testing.TB, rm metricdata.ResourceMetrics, source string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	sum := find(t, rm, "idem.requests").Data.(metricdata.Sum[int64])
	for _, dp := range sum.DataPoints {
		src, _ := dp.Attributes.Value(idemotel.AttrSource)
		if src.AsString() != source {
			continue
		}
		o, _ := dp.Attributes.Value(idemotel.AttrOutcome)
		out[o.AsString()] += dp.Value
	}
	return out
}

// httpDurationByOutcome counts otelhttp's request durations by idem.outcome.
func httpDurationByOutcome(t testing.TB, rm metricdata.ResourceMetrics) map[string]int {
	t.Helper()
	out := map[string]int{}
	h := find(t, rm, "http.server.request.duration").Data.(metricdata.Histogram[float64])
	for _, dp := range h.DataPoints {
		o, _ := dp.Attributes.Value(idemotel.AttrOutcome)
		out[o.AsString()] += int(dp.Count)
	}
	return out
}

func find(t testing.TB, rm metricdata.ResourceMetrics, name string) metricdata.Metrics {
	t.Helper()
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m
			}
		}
	}
	t.Fatalf("no metric %s", name)
	return metricdata.Metrics{}
}

func sumOf(t testing.TB, rm metricdata.ResourceMetrics, name string) int64 {
	t.Helper()
	var n int64
	for _, dp := range find(t, rm, name).Data.(metricdata.Sum[int64]).DataPoints {
		n += dp.Value
	}
	return n
}

// gauge is the value of one of Watch's instruments.
func gauge(t testing.TB, rm metricdata.ResourceMetrics, name string) int64 {
	t.Helper()
	return sumOf(t, rm, name)
}

func histCount(t testing.TB, rm metricdata.ResourceMetrics, name string) int64 {
	t.Helper()
	var n int64
	for _, dp := range find(t, rm, name).Data.(metricdata.Histogram[float64]).DataPoints {
		n += int64(dp.Count)
	}
	return n
}

// A phase's span reaches the span processor with its delivery's, at its
// own end time (so that a batch processor wakes once per delivery); past
// four phases (a duplicate that waits again and again), at once.
func TestPhaseSpansEndWithTheirDelivery(t *testing.T) {
	spans, tel := recordedSpans(t)
	key := idem.Key{Source: "test", EventID: "e1"}

	ctx, endDelivery := tel.OnPhase(context.Background(), idem.PhaseDelivery, key)
	var ends []time.Time
	for range 6 {
		_, end := tel.OnPhase(ctx, idem.PhaseWait, key)
		end(nil)
		ends = append(ends, time.Now())
	}
	require.Len(t, spans.Ended(), 2, "the fifth and sixth phases end at once")
	time.Sleep(5 * time.Millisecond) // not a wait: a gap that a wrong end time would show
	endDelivery(nil)

	got := spans.Ended()
	require.Len(t, got, 7)
	for i, s := range got[2:6] {
		assert.Equal(t, "idem.wait", s.Name())
		assert.False(t, s.EndTime().After(ends[i]), "phase %d ends when it ended, not with its delivery", i)
	}
	assert.Equal(t, "idem test", got[6].Name(), "the delivery's span ends last")
	assert.True(t, got[6].EndTime().After(ends[5].Add(5*time.Millisecond)))

	// A phase outside any delivery ends at once; so does one that ends
	// after its delivery did.
	_, end := tel.OnPhase(context.Background(), idem.PhaseClaim, key)
	end(nil)
	assert.Len(t, spans.Ended(), 8)
	_, late := tel.OnPhase(ctx, idem.PhaseCommit, key)
	late(nil)
	assert.Len(t, spans.Ended(), 9)
}

// Sources past the first thousand (built from the request, folded by
// WithSourceAttribute) are still counted under their label.
func TestManySourcesFoldedIntoOneLabel(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	tel, err := idemotel.New(idemotel.WithMeterProvider(mp), idemotel.WithTracerProvider(noop.NewTracerProvider()),
		idemotel.WithSourceAttribute(func(string) string { return "github" }))
	require.NoError(t, err)
	for n := range 1500 {
		key := idem.Key{Source: fmt.Sprintf("github:%d", n), EventID: "e"}
		ctx, end := tel.OnPhase(context.Background(), idem.PhaseDelivery, key)
		tel.Observe(idem.Observation{Outcome: idem.OutcomeCompleted, Key: key, Context: ctx})
		end(nil)
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	points := find(t, rm, "idem.requests").Data.(metricdata.Sum[int64]).DataPoints
	require.Len(t, points, 1)
	src, _ := points[0].Attributes.Value(idemotel.AttrSource)
	assert.Equal(t, "github", src.AsString())
	assert.EqualValues(t, 1500, points[0].Value)
}

// A call of Do inside a handler is a delivery of its own: observed
// without OnPhase, it gets its own span, and the outer delivery's keeps
// its own outcome.
func TestANestedDeliveryIsObservedOnItsOwnSpan(t *testing.T) {
	spans, tel := recordedSpans(t)
	outer, inner := idem.Key{Source: "outer", EventID: "e1"}, idem.Key{Source: "inner", EventID: "e2"}

	ctx, end := tel.OnPhase(context.Background(), idem.PhaseDelivery, outer)
	tel.Observe(idem.Observation{Outcome: idem.OutcomeReplayed, Key: inner, Context: ctx})
	tel.Observe(idem.Observation{Outcome: idem.OutcomeCompleted, Key: outer, Context: ctx})
	end(nil)

	got := spans.Ended()
	require.Len(t, got, 2)
	outcomes := map[string]string{}
	for _, s := range got {
		for _, kv := range s.Attributes() {
			if kv.Key == idemotel.AttrOutcome {
				outcomes[s.Name()] = kv.Value.AsString()
			}
		}
	}
	assert.Equal(t, map[string]string{"idem inner": "replayed", "idem outer": "completed"}, outcomes)
}

// recordedSpans is an Instrumentation whose ended spans spans records.
func recordedSpans(t *testing.T) (*tracetest.SpanRecorder, *idemotel.Instrumentation) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tel, err := idemotel.New(idemotel.WithTracerProvider(tp))
	require.NoError(t, err)
	return spans, tel
}
