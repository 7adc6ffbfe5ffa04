// Package idemotel shows what github.com/pgidem/idem decides for each
// delivery in the OpenTelemetry traces and metrics a service already has.
// It is a module of its own, so that OpenTelemetry stays off the library's
// go.mod:
//
//	go get github.com/pgidem/idem/idemotel@latest
//
//	tel, err := idemotel.New() // the global TracerProvider and MeterProvider
//	if err != nil { ... }
//	mw, err := idem.New(db, idem.Options{
//		KeyFunc:  idem.Stripe(secret),
//		Observer: tel.Observe, // or idem.Observers(prom.Observe, tel.Observe)
//		OnPhase:  tel.OnPhase,
//	})
//	if err != nil { ... }
//	reg, err := tel.Watch(mw) // the gauges; reg.Unregister() when mw is done
//
// # Traces
//
// Each delivery (an HTTP request the middleware claims, or a call of
// Middleware.Do) gets a span named "idem <source>", a child of the
// request's span (otelhttp's, when the server is wrapped in
// otelhttp.NewHandler), with a child span for each phase: "idem.claim"
// (beginning the transaction and claiming the key, or finding its answer),
// "idem.wait" (a duplicate waiting for an original of its key, in memory
// or in PostgreSQL inside the claim), "idem.handler" (the wrapped handler,
// or Do's fn) and "idem.commit" (storing the answer and COMMIT), each with
// its real start and end. A phase's span reaches the span processors when
// its delivery's does, with its own end time, so that a batch span
// processor's goroutine wakes once for a delivery rather than once for
// each span; until then it is still recording (what code that outlives the
// phase adds to it through trace.SpanFromContext is kept). The handler's
// context, and the context of the claim's and the COMMIT's statements,
// carry these spans: a traced driver (otelpgx in pgx's tracer slot,
// otelsql for database/sql) records its SQL spans under them.
//
// No semantic conventions exist for idempotency; the spans' attributes are
// these (see the constants below):
//
//   - idem.source: the key's source (its scope).
//   - idem.outcome: what became of the delivery, idem.Outcome's String
//     (completed, replayed, in_flight, mismatch, rolled_back, rejected,
//     store_error, conflict, fenced).
//   - idem.took_over: the delivery took the key over from a lease-mode
//     original whose lease ran out (a crashed or frozen original).
//   - idem.cached: the answer was replayed from this instance's memory,
//     without the database.
//   - idem.waited: seconds spent waiting for an original of the
//     key, when there was a wait.
//   - idem.event_id: the key's event id, only with WithEventID: in some
//     APIs an idempotency key is a secret, or personal data, and traces
//     are often kept longer and seen by more people than the database.
//   - error.type: for a delivery that failed, its outcome (store_error,
//     rolled_back, conflict, fenced); for a phase that failed, the kind of
//     error: unavailable, conflict, handler_timeout, lease_expired,
//     tx_aborted, tx_misuse, canceled, or _OTHER (the handler's or fn's own
//     error, a panic).
//
// A failed delivery or phase has the span status Error, with error.type;
// errors are not recorded as span events (the OpenTelemetry Go contrib
// rules). A duplicate answered 409 (in_flight), a body that does not match
// its key (mismatch) and a rejected request are answers, not failures: their
// spans keep status Unset, as an HTTP server's span does for a 4xx.
// The request's body is never recorded.
//
// # Metrics
//
// Under the meter named ScopeName:
//
//   - idem.requests {request}: a counter of deliveries, by idem.outcome and
//     idem.source.
//   - idem.claim.duration, idem.wait.duration, idem.handler.duration,
//     idem.commit.duration (s): histograms of each phase, by idem.source
//     (and error.type for a phase that failed), with boundaries from half a
//     millisecond to 30 seconds (DurationBoundaries). They need OnPhase.
//   - idem.replay_cache.hits {request}: a counter of the deliveries
//     answered from the replay cache, by idem.source.
//   - idem.replay_cache.size (By) and idem.replay_cache.entries {entry}: what
//     the replay cache holds (Watch).
//   - idem.waiting.connections {connection}: the pooled connections held by
//     duplicates waiting in PostgreSQL for an original; and
//     idem.waiting.in_memory {request}: duplicates waiting in memory, with
//     no connection, for a delivery of their key on this instance (Watch).
//
// Cardinality: idem.source is a label, so it must come from a small set.
// The presets scope each key by endpoint ("stripe POST /webhooks/stripe"),
// so their sources are as many as the routes that use them, like
// http.route; a source built from the request (idem.GitHub's
// "github:<hook id>", a tenant) grows with what it is built from: fold it
// into a small set, or drop it, with WithSourceAttribute. The event id is
// never a metric attribute.
//
// With otelhttp, Observe also adds idem.outcome to otelhttp's own server
// metrics (otelhttp.LabelerFromContext), so http.server.request.duration
// can be split by idem's outcome.
package idemotel

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem"
)

// ScopeName is the instrumentation scope name of the tracer and the meter:
// this package's import path.
const ScopeName = "github.com/pgidem/idem/idemotel"

// Version is the version of this instrumentation, the version of the
// module it is released in.
const Version = "0.1.0"

// The attributes idemotel records; see the package doc.
const (
	AttrSource    = attribute.Key("idem.source")
	AttrOutcome   = attribute.Key("idem.outcome")
	AttrTookOver  = attribute.Key("idem.took_over")
	AttrCached    = attribute.Key("idem.cached")
	AttrWaited    = attribute.Key("idem.waited")
	AttrEventID   = attribute.Key("idem.event_id")
	attrErrorType = attribute.Key("error.type")
)

// DurationBoundaries are the explicit bucket boundaries of the phase
// histograms, in seconds: from half a millisecond (a claim on a local
// PostgreSQL) to 30 seconds (the longest HandlerTimeout most services set).
var DurationBoundaries = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// Option configures New.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	tp          trace.TracerProvider
	mp          metric.MeterProvider
	sourceLabel func(string) string
	eventID     bool
}

// WithTracerProvider sets the TracerProvider the spans are made with. The
// default (and nil) is the global one, otel.GetTracerProvider().
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) {
		if tp != nil {
			c.tp = tp
		}
	})
}

// WithMeterProvider sets the MeterProvider the metrics are made with. The
// default (and nil) is the global one, otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) {
		if mp != nil {
			c.mp = mp
		}
	})
}

// WithSourceAttribute maps a key's source to the idem.source attribute of
// the metrics, to bound their cardinality: fold sources built from the
// request into a small set, or return "" to leave the attribute out. The
// spans keep the source as it is. The default keeps it on metrics too.
// label is called at a source's first delivery (and, past the first 1,000
// sources, at each delivery of the others): it must give a source the
// same label every time.
func WithSourceAttribute(label func(source string) string) Option {
	return optionFunc(func(c *config) { c.sourceLabel = label })
}

// WithEventID records the key's event id on the spans (idem.event_id). It
// is off by default: some APIs take a secret, or personal data, as their
// idempotency key, and traces are often kept longer, and read by more
// people, than the database that holds the keys.
func WithEventID() Option {
	return optionFunc(func(c *config) { c.eventID = true })
}

// Instrumentation traces and measures the deliveries of one or more
// middlewares: pass its Observe method as idem.Options.Observer (alone or
// through idem.Observers) and its OnPhase method as idem.Options.OnPhase,
// and call Watch for each middleware for its gauges. It is safe for
// concurrent use.
type Instrumentation struct {
	tracer      trace.Tracer
	sourceLabel func(string) string
	eventID     bool

	requests  metric.Int64Counter
	cacheHits metric.Int64Counter
	durations [len(phaseSpanNames)]metric.Float64Histogram // by idem.Phase; PhaseDelivery's unused
	cacheSize metric.Int64ObservableUpDownCounter
	cacheLen  metric.Int64ObservableUpDownCounter
	waitConns metric.Int64ObservableUpDownCounter
	waitMem   metric.Int64ObservableUpDownCounter
	meter     metric.Meter

	sources bounded[*source]    // by a key's source, made once for each
	labels  bounded[*labelSets] // by metric label
}

// bounded is a map safe for concurrent use that keeps at most maxSources
// entries.
type bounded[V any] struct {
	m sync.Map
	n atomic.Int32
}

func (b *bounded[V]) load(k string) (V, bool) {
	v, ok := b.m.Load(k)
	if !ok {
		var zero V
		return zero, false
	}
	return v.(V), true
}

// keep stores v under k, unless the map is full, and returns what k holds
// (or v).
func (b *bounded[V]) keep(k string, v V) V {
	if b.n.Load() >= maxSources {
		return v
	}
	got, loaded := b.m.LoadOrStore(k, v)
	if !loaded {
		b.n.Add(1)
	}
	return got.(V)
}

// maxSources bounds what Instrumentation keeps for sources, and for labels:
// past it (sources built from the request, a tenant's id), each delivery
// of a source not kept makes its span's name and start attributes again,
// and finds its label's sets among those kept.
const maxSources = 1000

// source is what idemotel records for every delivery of one source, made
// at its first delivery so that later ones allocate none of it: the
// span's name and start attributes, and the metrics' attribute sets.
type source struct {
	spanName  string
	spanStart trace.SpanStartOption // idem.source on the delivery's span
	*labelSets
}

// labelSets are the metrics' attribute sets of one idem.source label,
// which several sources may share (WithSourceAttribute).
type labelSets struct {
	label    string
	plain    metric.MeasurementOption
	outcomes [idem.OutcomeFenced + 1]metric.MeasurementOption // idem.requests' sets, by outcome
}

// New makes the tracer and the instruments. It fails only if the
// MeterProvider refuses an instrument.
func New(opts ...Option) (*Instrumentation, error) {
	c := config{tp: otel.GetTracerProvider(), mp: otel.GetMeterProvider()}
	for _, o := range opts {
		o.apply(&c)
	}
	i := &Instrumentation{
		tracer:      c.tp.Tracer(ScopeName, trace.WithInstrumentationVersion(Version)),
		meter:       c.mp.Meter(ScopeName, metric.WithInstrumentationVersion(Version)),
		sourceLabel: c.sourceLabel,
		eventID:     c.eventID,
	}
	var err, e error
	i.requests, err = i.meter.Int64Counter("idem.requests", metric.WithUnit("{request}"),
		metric.WithDescription("Deliveries handled by the idempotency middleware, by outcome and source."))
	i.cacheHits, e = i.meter.Int64Counter("idem.replay_cache.hits", metric.WithUnit("{request}"),
		metric.WithDescription("Deliveries answered from the replay cache, without the database."))
	err = errors.Join(err, e)
	for p, name := range phaseSpanNames {
		if name == "" || idem.Phase(p) == idem.PhaseDelivery {
			continue
		}
		i.durations[p], e = i.meter.Float64Histogram(name+".duration", metric.WithUnit("s"),
			metric.WithDescription("Duration of the "+name[len("idem."):]+" phase of a delivery."),
			metric.WithExplicitBucketBoundaries(DurationBoundaries...))
		err = errors.Join(err, e)
	}
	i.cacheSize, e = i.meter.Int64ObservableUpDownCounter("idem.replay_cache.size", metric.WithUnit("By"),
		metric.WithDescription("Heap held by the replay cache."))
	err = errors.Join(err, e)
	i.cacheLen, e = i.meter.Int64ObservableUpDownCounter("idem.replay_cache.entries", metric.WithUnit("{entry}"),
		metric.WithDescription("Answers held by the replay cache."))
	err = errors.Join(err, e)
	i.waitConns, e = i.meter.Int64ObservableUpDownCounter("idem.waiting.connections", metric.WithUnit("{connection}"),
		metric.WithDescription("Pooled connections held by duplicates waiting in PostgreSQL for an original."))
	err = errors.Join(err, e)
	i.waitMem, e = i.meter.Int64ObservableUpDownCounter("idem.waiting.in_memory", metric.WithUnit("{request}"),
		metric.WithDescription("Duplicates waiting in memory, without a connection, for a delivery of their key on this instance."))
	err = errors.Join(err, e)
	if err != nil {
		return nil, err
	}
	return i, nil
}

// Watch reports m's gauges (the replay cache's size and entries, the
// waiting duplicates) at each collection, with attrs added to tell
// several middlewares apart. Unregister the Registration when m is no
// longer used.
func (i *Instrumentation) Watch(m *idem.Middleware, attrs ...attribute.KeyValue) (metric.Registration, error) {
	set := metric.WithAttributeSet(attribute.NewSet(attrs...))
	return i.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := m.Stats()
		o.ObserveInt64(i.cacheSize, s.ReplayCacheBytes, set)
		o.ObserveInt64(i.cacheLen, int64(s.ReplayCacheEntries), set)
		o.ObserveInt64(i.waitConns, int64(s.WaitingInPostgres), set)
		o.ObserveInt64(i.waitMem, int64(s.WaitingInMemory), set)
		return nil
	}, i.cacheSize, i.cacheLen, i.waitConns, i.waitMem)
}

// phaseSpanNames are the spans' names of the phases, by idem.Phase.
var phaseSpanNames = [...]string{
	idem.PhaseClaim:   "idem.claim",
	idem.PhaseWait:    "idem.wait",
	idem.PhaseHandler: "idem.handler",
	idem.PhaseCommit:  "idem.commit",
}

type deliveryKey struct{}

// delivery is one delivery's span, found through the context OnPhase
// returned for PhaseDelivery.
type delivery struct {
	span trace.Span
	src  *source
	key  idem.Key // whose delivery: a nested call of Do has its own

	// The spans of the phases that ended, ended with the delivery's span
	// at their own end times: a batch span processor's goroutine then
	// wakes once for all of them, not once for each (a few microseconds
	// each, under load).
	mu     sync.Mutex
	done   bool // the delivery's span ended: a phase ends its span at once
	n      int
	phases [4]endedPhase
}

// endedPhase is a phase's span to end at.
type endedPhase struct {
	span trace.Span
	at   time.Time
}

// OnPhase starts the span of a delivery ("idem <source>") or of one of its
// phases, and returns the context that carries it and the function that
// ends it. Pass it as idem.Options.OnPhase.
func (i *Instrumentation) OnPhase(ctx context.Context, p idem.Phase, key idem.Key) (context.Context, func(error)) {
	if p == idem.PhaseDelivery {
		d := &delivery{src: i.source(key.Source), key: key}
		if i.eventID {
			ctx, d.span = i.tracer.Start(ctx, d.src.spanName, d.src.spanStart, trace.WithAttributes(AttrEventID.String(key.EventID)))
		} else {
			ctx, d.span = i.tracer.Start(ctx, d.src.spanName, d.src.spanStart)
		}
		return context.WithValue(ctx, deliveryKey{}, d), d.end
	}
	if int(p) >= len(phaseSpanNames) || phaseSpanNames[p] == "" {
		return ctx, nil // a phase this version does not know
	}
	d, _ := ctx.Value(deliveryKey{}).(*delivery)
	if d != nil && d.key != key {
		d = nil // a delivery around this one: a call of Do inside a handler
	}
	var src *source
	if d != nil {
		src = d.src
	} else {
		src = i.source(key.Source)
	}
	start := time.Now()
	ctx, span := i.tracer.Start(ctx, phaseSpanNames[p])
	return ctx, func(err error) { i.endPhase(ctx, p, span, start, d, src, err) }
}

// endPhase ends a phase: its span (with its delivery's, if it has one)
// and its duration.
func (i *Instrumentation) endPhase(ctx context.Context, p idem.Phase, span trace.Span, start time.Time, d *delivery, src *source, err error) {
	now := time.Now()
	opt := src.plain
	if typ, failed := errorType(err); failed {
		span.SetStatus(codes.Error, typ)
		span.SetAttributes(attrErrorType.String(typ))
		opt = metric.WithAttributes(AttrSource.String(src.label), attrErrorType.String(typ))
		if src.label == "" {
			opt = metric.WithAttributes(attrErrorType.String(typ))
		}
	}
	if d == nil || !d.endLater(span, now) {
		span.End(trace.WithTimestamp(now))
	}
	i.durations[p].Record(ctx, now.Sub(start).Seconds(), opt)
}

// endLater keeps a phase's span to end with the delivery's, and reports
// whether it did: not once the delivery's has ended, nor past a few.
func (d *delivery) endLater(span trace.Span, at time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.done || d.n == len(d.phases) {
		return false
	}
	d.phases[d.n] = endedPhase{span, at}
	d.n++
	return true
}

// end ends the spans of the delivery's phases, at their end times, then
// the delivery's; Observe, called just before, has set its outcome.
func (d *delivery) end(error) {
	d.mu.Lock()
	d.done = true
	phases := d.phases[:d.n]
	d.mu.Unlock()
	for _, e := range phases {
		e.span.End(trace.WithTimestamp(e.at))
	}
	d.span.End()
}

// Observe records one delivery: its outcome on its span (the one OnPhase
// started, or, without OnPhase, one made now with the delivery's start
// time), the counters, and idem.outcome on otelhttp's server metrics.
// Pass it as idem.Options.Observer, or through idem.Observers.
func (i *Instrumentation) Observe(o idem.Observation) {
	ctx := o.Context
	if ctx == nil {
		ctx = context.Background()
	}
	outcome := o.Outcome.String()
	d, traced := ctx.Value(deliveryKey{}).(*delivery)
	traced = traced && d.key == o.Key // not a delivery around this one (Do inside a handler)
	if !traced {
		// No OnPhase, or a request rejected before its key was known.
		d = &delivery{src: i.source(o.Key.Source)}
		_, d.span = i.tracer.Start(ctx, d.src.spanName, trace.WithTimestamp(time.Now().Add(-o.Duration)), d.src.spanStart)
		if i.eventID && o.Key.EventID != "" {
			d.span.SetAttributes(AttrEventID.String(o.Key.EventID))
		}
	}
	if d.span.IsRecording() {
		var buf [5]attribute.KeyValue // one SetAttributes: the span's slice grows once
		attrs := append(buf[:0], AttrOutcome.String(outcome), AttrTookOver.Bool(o.TookOver), AttrCached.Bool(o.Cached))
		if o.Wait > 0 {
			attrs = append(attrs, AttrWaited.Float64(o.Wait.Seconds()))
		}
		if failed(o.Outcome) {
			d.span.SetStatus(codes.Error, outcome)
			attrs = append(attrs, attrErrorType.String(outcome))
		}
		d.span.SetAttributes(attrs...)
	}
	if !traced {
		d.span.End()
	}
	i.requests.Add(ctx, 1, d.src.requests(o.Outcome))
	if o.Cached && o.Outcome == idem.OutcomeReplayed {
		i.cacheHits.Add(ctx, 1, d.src.plain)
	}
	if l, ok := otelhttp.LabelerFromContext(ctx); ok {
		l.Add(AttrOutcome.String(outcome))
	}
}

// failed reports the outcomes whose span has status Error: the middleware
// could not complete the work. The others are answers.
func failed(o idem.Outcome) bool {
	switch o {
	case idem.OutcomeStoreError, idem.OutcomeRolledBack, idem.OutcomeConflict, idem.OutcomeFenced:
		return true
	}
	return false
}

// errorType is a phase error's error.type, and whether it is a failure:
// a wait or a claim that ends in a 409 for an original in flight, or a 422,
// is an answer, not a failure.
func errorType(err error) (string, bool) {
	switch {
	case err == nil, errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrPayloadMismatch):
		return "", false
	case errors.Is(err, idem.ErrUnavailable):
		return "unavailable", true
	case errors.Is(err, idem.ErrConflict):
		return "conflict", true
	case errors.Is(err, idem.ErrHandlerTimeout), errors.Is(err, context.DeadlineExceeded):
		return "handler_timeout", true
	case errors.Is(err, idem.ErrLeaseExpired):
		return "lease_expired", true
	case errors.Is(err, idem.ErrTxAborted):
		return "tx_aborted", true
	case errors.Is(err, idem.ErrTxMisuse):
		return "tx_misuse", true
	case errors.Is(err, context.Canceled):
		return "canceled", true
	}
	return "_OTHER", true
}

// source returns what idemotel records for every delivery of a key's
// source, made at its first delivery.
func (i *Instrumentation) source(name string) *source {
	if src, ok := i.sources.load(name); ok {
		return src
	}
	label := name
	if i.sourceLabel != nil && name != "" {
		label = i.sourceLabel(name)
	}
	src := &source{spanName: "idem", spanStart: trace.WithAttributes(AttrSource.String(name)), labelSets: i.labelSets(label)}
	if name != "" {
		src.spanName += " " + name
	}
	return i.sources.keep(name, src)
}

// labelSets returns the metrics' attribute sets of label, made once.
func (i *Instrumentation) labelSets(label string) *labelSets {
	if ls, ok := i.labels.load(label); ok {
		return ls
	}
	ls := &labelSets{label: label, plain: metricSet(label, "")}
	for o := range ls.outcomes {
		if o > 0 {
			ls.outcomes[o] = metricSet(label, idem.Outcome(o).String())
		}
	}
	return i.labels.keep(label, ls)
}

// requests is idem.requests' attribute set for a delivery of outcome o.
func (ls *labelSets) requests(o idem.Outcome) metric.MeasurementOption {
	if o > 0 && int(o) < len(ls.outcomes) {
		return ls.outcomes[o]
	}
	return metricSet(ls.label, o.String()) // an outcome this version does not know
}

// metricSet is the attribute set of a source label and an outcome (either
// may be empty, and is then left out).
func metricSet(label, outcome string) metric.MeasurementOption {
	var attrs []attribute.KeyValue
	if label != "" {
		attrs = append(attrs, AttrSource.String(label))
	}
	if outcome != "" {
		attrs = append(attrs, AttrOutcome.String(outcome))
	}
	return metric.WithAttributeSet(attribute.NewSet(attrs...))
}
