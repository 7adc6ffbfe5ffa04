package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// maxTries bounds how often one delivery is sent before the sender gives up
// on it, as a provider eventually does.
const maxTries = 20

// answer is what one request got back.
type answer struct {
	status     int // 0 when the request itself failed
	replayed   bool
	body       []byte
	retryAfter time.Duration // from Retry-After; a second when absent
}

func (a answer) ok() bool { return a.status >= 200 && a.status < 300 }

// event is one order event and what became of its deliveries.
type event struct {
	id     string
	body   []byte
	reused []byte // nil, or a body with the same id and another amount

	answers      []answer // the final answer of each delivery, after retries
	reusedAnswer answer
}

// storm sends the deliveries and keeps count.
type storm struct {
	cfg    config
	url    string
	client *http.Client
	slots  chan struct{} // one per request in flight
	events []*event

	sent, answered, eventsDone  atomic.Int64
	conflicts, mismatches, errs atomic.Int64

	mu        sync.Mutex
	latencies []time.Duration
}

// result sums up the run as the sender saw it.
type result struct {
	wall      time.Duration
	latencies []time.Duration // sorted
	sent      int64
	conflicts int64 // 409 answers, each retried
	errs      int64 // 5xx answers and failed requests, each retried
}

func newStorm(cfg config, url string) *storm {
	st := &storm{
		cfg: cfg,
		url: url,
		client: &http.Client{
			Timeout:   time.Minute,
			Transport: &http.Transport{MaxIdleConnsPerHost: cfg.concurrency, MaxConnsPerHost: cfg.concurrency},
		},
		slots: make(chan struct{}, cfg.concurrency),
	}
	for i := range cfg.events {
		ev := orderEvent{ID: fmt.Sprintf("ord_%06d", i+1), Type: "order.paid", Amount: int64(100 + (i*7919)%10000)}
		ev.Slow = cfg.slowEvery > 0 && i%cfg.slowEvery == cfg.slowEvery/2
		e := &event{id: ev.ID, body: mustJSON(ev), answers: make([]answer, cfg.deliveries)}
		if cfg.reuseEvery > 0 && i%cfg.reuseEvery == cfg.reuseEvery/3 {
			ev.Amount++ // the same id, another body
			e.reused = mustJSON(ev)
		}
		st.events = append(st.events, e)
	}
	return st
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// run delivers every event and waits for the last answer. At most
// ceil(concurrency/deliveries) events start their first round at once, so
// the deliveries of one event really are concurrent.
func (st *storm) run(ctx context.Context, p *progress) result {
	start := time.Now()
	p.start()
	eventSlots := make(chan struct{}, max(1, (st.cfg.concurrency+st.cfg.deliveries-1)/st.cfg.deliveries))
	var wg sync.WaitGroup
	for _, e := range st.events {
		select {
		case eventSlots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			st.runEvent(ctx, e, func() { <-eventSlots })
			st.eventsDone.Add(1)
		})
	}
	wg.Wait()
	p.stop()
	st.mu.Lock()
	defer st.mu.Unlock()
	slices.Sort(st.latencies)
	return result{
		wall: time.Since(start), latencies: st.latencies,
		sent: st.sent.Load(), conflicts: st.conflicts.Load(), errs: st.errs.Load(),
	}
}

// runEvent sends the event's deliveries at once, calls release when each has
// had its first answer, retries those that were told to, and finally sends
// the delivery with a reused id, once the event has completed.
func (st *storm) runEvent(ctx context.Context, e *event, release func()) {
	first := make([]answer, len(e.answers))
	var wg sync.WaitGroup
	for i := range first {
		wg.Go(func() { first[i] = st.send(ctx, e.body) })
	}
	wg.Wait()
	release()
	for i, a := range first {
		wg.Go(func() { e.answers[i] = st.retry(ctx, e.body, a) })
	}
	wg.Wait()
	if e.reused != nil {
		e.reusedAnswer = st.retry(ctx, e.reused, st.send(ctx, e.reused))
	}
}

// retry sends body again after each answer that invites a retry (409, 5xx,
// no answer at all), waiting Retry-After first, as providers do, until
// another answer or maxTries.
func (st *storm) retry(ctx context.Context, body []byte, a answer) answer {
	for try := 1; try < maxTries && ctx.Err() == nil; try++ {
		if a.status != 0 && a.status != http.StatusConflict && a.status < 500 {
			return a
		}
		select {
		case <-time.After(a.retryAfter):
		case <-ctx.Done():
			return a
		}
		a = st.send(ctx, body)
	}
	return a
}

// send makes one request, holding a slot while it is in flight.
func (st *storm) send(ctx context.Context, body []byte) answer {
	select {
	case st.slots <- struct{}{}:
	case <-ctx.Done():
		return answer{retryAfter: time.Second}
	}
	defer func() { <-st.slots }()
	st.sent.Add(1)
	start := time.Now()
	a := st.post(ctx, body)
	took := time.Since(start)
	st.answered.Add(1)
	switch {
	case a.status == http.StatusConflict:
		st.conflicts.Add(1)
	case a.status == http.StatusUnprocessableEntity:
		st.mismatches.Add(1)
	case a.status == 0 || a.status >= 500:
		st.errs.Add(1)
	}
	st.mu.Lock()
	st.latencies = append(st.latencies, took)
	st.mu.Unlock()
	return a
}

func (st *storm) post(ctx context.Context, body []byte) answer {
	failed := answer{retryAfter: time.Second}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.url, bytes.NewReader(body))
	if err != nil {
		return failed
	}
	req.Header.Set("Content-Type", "application/json")
	res, err := st.client.Do(req)
	if err != nil {
		return failed
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return failed
	}
	a := answer{status: res.StatusCode, replayed: res.Header.Get("Idempotent-Replayed") == "true", body: b, retryAfter: time.Second}
	if secs, err := strconv.Atoi(res.Header.Get("Retry-After")); err == nil && secs >= 0 {
		a.retryAfter = time.Duration(secs) * time.Second
	}
	return a
}

// percentile returns the p-th percentile (0 < p <= 100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
