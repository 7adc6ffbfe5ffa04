// Package idemprom exports what github.com/pgidem/idem's middleware does as
// Prometheus metrics. It is a module of its own, so that the Prometheus
// client stays off the library's go.mod:
//
//	go get github.com/pgidem/idem/idemprom@latest
//
//	metrics, err := idemprom.New(prometheus.DefaultRegisterer, idemprom.Options{})
//	if err != nil { ... }
//	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe(), Observer: metrics.Observe})
//
// It registers three metrics:
//
//   - idem_requests_total{source,outcome,code}: a counter of the requests the
//     middleware handled, by the key's source (empty when the request was
//     rejected before its key was known), the outcome (completed, replayed,
//     in_flight, mismatch, rolled_back, rejected, store_error, conflict,
//     fenced: idem.Outcome's String) and the HTTP status sent ("0" when the
//     handler panicked and nothing was sent).
//   - idem_request_duration_seconds{outcome}: a histogram of the time from the
//     middleware's start to its answer.
//   - idem_lock_wait_seconds{outcome}: a histogram of the time duplicates
//     spent waiting for an in-flight original with the same key, observed
//     only for requests that waited, by the outcome the wait led to
//     (replayed, in_flight when LockWait ran out, completed when the
//     original rolled back, mismatch).
//
// The event id is never a label: every event would be a new time series.
// The source is one, so it must come from a small set; see
// Options.SourceLabel. To observe two middlewares in one process, register
// each through prometheus.WrapRegistererWith with a label that tells them
// apart.
package idemprom

import (
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/idem"
)

// Options configures the metrics. The zero value is ready to use.
type Options struct {
	// SourceLabel maps a key's source to the value of the source label. nil
	// means the source up to its first space: a preset's endpoint scope
	// ("stripe POST /webhooks/stripe") counts as "stripe", and a fixed
	// source as itself. Sources taken from the request, such as
	// idem.GitHub()'s "github:<hook id>" or a tenant id, should be folded
	// into a small set here, or dropped by returning "".
	SourceLabel func(source string) string

	// DurationBuckets are the buckets of idem_request_duration_seconds, in
	// seconds. nil means prometheus.DefBuckets (5ms to 10s).
	DurationBuckets []float64

	// WaitBuckets are the buckets of idem_lock_wait_seconds, in seconds. nil
	// means prometheus.DefBuckets; keep the largest near Options.LockWait of
	// the middleware (2s by default).
	WaitBuckets []float64
}

// Metrics counts the middleware's outcomes; pass its Observe method as
// idem.Options.Observer. It is safe for concurrent use.
type Metrics struct {
	requests    *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	wait        *prometheus.HistogramVec
	sourceLabel func(string) string
}

// New creates the metrics and registers them with reg. It fails, and
// registers nothing, if reg already has metrics of the same names.
func New(reg prometheus.Registerer, opts Options) (*Metrics, error) {
	durationBuckets, waitBuckets := opts.DurationBuckets, opts.WaitBuckets
	if durationBuckets == nil {
		durationBuckets = prometheus.DefBuckets
	}
	if waitBuckets == nil {
		waitBuckets = prometheus.DefBuckets
	}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_requests_total",
			Help: "Requests handled by the idempotency middleware, by key source, outcome and HTTP status code.",
		}, []string{"source", "outcome", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_request_duration_seconds",
			Help:    "Time from the idempotency middleware's start to its answer, by outcome.",
			Buckets: durationBuckets,
		}, []string{"outcome"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_lock_wait_seconds",
			Help:    "Time duplicates waited for an in-flight original with the same key, by the outcome the wait led to.",
			Buckets: waitBuckets,
		}, []string{"outcome"}),
		sourceLabel: opts.SourceLabel,
	}
	collectors := []prometheus.Collector{m.requests, m.duration, m.wait}
	for i, c := range collectors {
		if err := reg.Register(c); err != nil {
			for _, done := range collectors[:i] {
				reg.Unregister(done)
			}
			return nil, err
		}
	}
	return m, nil
}

// Observe records one observation. Pass it as idem.Options.Observer, or call
// it from an Observer of your own.
func (m *Metrics) Observe(o idem.Observation) {
	source := o.Key.Source
	switch {
	case source == "":
	case m.sourceLabel != nil:
		source = m.sourceLabel(source)
	default:
		source, _, _ = strings.Cut(source, " ")
	}
	outcome := o.Outcome.String()
	m.requests.WithLabelValues(source, outcome, strconv.Itoa(o.Status)).Inc()
	m.duration.WithLabelValues(outcome).Observe(o.Duration.Seconds())
	if o.Wait > 0 {
		m.wait.WithLabelValues(outcome).Observe(o.Wait.Seconds())
	}
}
