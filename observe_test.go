package idem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// phaseLog records what Options.OnPhase sees: "+name" at a phase's start,
// "-name" (or "-name!" with an error) at its end, and the depth of phases
// open around each start, read from the context OnPhase returned before.
type phaseLog struct {
	mu     sync.Mutex
	events []string
}

type depthKey struct{}

var phaseNames = map[idem.Phase]string{idem.PhaseDelivery: "delivery", idem.PhaseClaim: "claim",
	idem.PhaseWait: "wait", idem.PhaseHandler: "handler", idem.PhaseCommit: "commit"}

func (l *phaseLog) add(e string) {
	l.mu.Lock()
	l.events = append(l.events, e)
	l.mu.Unlock()
}

func (l *phaseLog) onPhase(ctx context.Context, p idem.Phase, key idem.Key) (context.Context, func(error)) {
	depth, _ := ctx.Value(depthKey{}).(int)
	name := phaseNames[p]
	l.add(fmt.Sprintf("+%s@%d", name, depth))
	return context.WithValue(ctx, depthKey{}, depth+1), func(err error) {
		if err != nil {
			l.add("-" + name + "!")
			return
		}
		l.add("-" + name)
	}
}

// take returns what was recorded and forgets it.
func (l *phaseLog) take() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := strings.Join(l.events, " ")
	l.events = nil
	return s
}

// OnPhase sees each phase start and end, nested: the claim, the handler
// and the COMMIT inside the delivery, the wait in PostgreSQL inside the
// claim; the handler's context and the Observation's are those OnPhase
// returned; the Observer runs before the delivery ends.
func TestOnPhaseNestsThePhasesOfADelivery(t *testing.T) {
	log := &phaseLog{}
	var handlerDepth atomic.Int64
	var held atomic.Pointer[gate]
	var f *fixture
	f = newFixture(t, idem.Options{OnPhase: log.onPhase, Observer: func(o idem.Observation) {
		d, _ := o.Context.Value(depthKey{}).(int)
		log.add(fmt.Sprintf("observe %s@%d", o.Outcome, d))
	}}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, _ := r.Context().Value(depthKey{}).(int)
		handlerDepth.Store(int64(d))
		if g := held.Load(); g != nil {
			g.hold()
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))

	t.Run("a new event: claim, handler, commit inside the delivery", func(t *testing.T) {
		r := f.post("evt_new", `{"n":1}`)
		require.Equal(t, http.StatusCreated, r.status)
		assert.Equal(t, "+delivery@0 +claim@1 -claim +handler@1 -handler +commit@1 -commit observe completed@1 -delivery", log.take())
		assert.Equal(t, int64(2), handlerDepth.Load(), "the handler's context derives from the one OnPhase returned for it")
	})
	t.Run("a replay from the database: the claim only", func(t *testing.T) {
		r := f.post("evt_new", `{"n":1}`)
		require.Equal(t, http.StatusCreated, r.status)
		assert.Equal(t, "+delivery@0 +claim@1 -claim observe replayed@1 -delivery", log.take())
	})
	t.Run("a replay from memory: no phase but the delivery", func(t *testing.T) {
		r := f.post("evt_new", `{"n":1}`)
		require.Equal(t, http.StatusCreated, r.status)
		assert.Equal(t, "+delivery@0 observe replayed@1 -delivery", log.take())
	})
	t.Run("a duplicate on another instance waits in PostgreSQL, inside its claim", func(t *testing.T) {
		g2 := newGate()
		held.Store(g2)
		t.Cleanup(g2.open)
		orig := f.startOriginal(g2, "evt_wait", `{"n":2}`)
		other := &phaseLog{}
		otherMW, otherSrv := f.serveOn(f.db, idem.Options{OnPhase: other.onPhase})
		dup := make(chan reply, 1)
		go func() { dup <- f.sendTo(otherSrv.URL, "evt_wait", `{"n":2}`) }()
		testdb.WaitFor(t, "the duplicate to wait in PostgreSQL", func() bool { return otherMW.Stats().WaitingInPostgres == 1 })
		g2.open()
		require.Equal(t, http.StatusCreated, (<-orig).status)
		require.Equal(t, http.StatusCreated, (<-dup).status)
		assert.Equal(t, "+delivery@0 +claim@1 +wait@2 -wait -claim -delivery", other.take())
		assert.Equal(t, 0, otherMW.Stats().WaitingInPostgres)
		log.take()
	})
	t.Run("a call of Do: the same phases, fn's error ends the handler's", func(t *testing.T) {
		key := idem.Key{Source: "test", EventID: "do_fails"}
		_, err := f.mw.Do(context.Background(), key, nil, func(context.Context) ([]byte, error) {
			return nil, errors.New("boom")
		})
		require.Error(t, err)
		assert.Equal(t, "+delivery@0 +claim@1 -claim +handler@1 -handler! observe rolled_back@1 -delivery!", log.take())
	})
	t.Run("an Observer that panics: the delivery still ends", func(t *testing.T) {
		other := &phaseLog{}
		otherMW, _ := f.serveOn(f.db, idem.Options{OnPhase: other.onPhase, Observer: func(idem.Observation) { panic("observer") }})
		key := idem.Key{Source: "test", EventID: "observer_panics"}
		assert.PanicsWithValue(t, "observer", func() {
			_, _ = otherMW.Do(context.Background(), key, nil, func(context.Context) ([]byte, error) { return []byte("ok"), nil })
		})
		assert.Equal(t, "+delivery@0 +claim@1 -claim +handler@1 -handler +commit@1 -commit -delivery", other.take())
	})
}

// sendTo posts a delivery of id to another server of the same handler.
func (f *fixture) sendTo(url, id, body string) reply {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(f.t, err)
	req.Header.Set("X-Event-Id", id)
	return f.send(req)
}

// The Observation carries the request's context, and Do's, when no OnPhase
// is set; Observers hands it to each observer; Stats counts the replay
// cache.
func TestObservationCarriesTheRequestsContext(t *testing.T) {
	type reqKey struct{}
	var mu sync.Mutex
	var seen, seen2 []string
	record := func(into *[]string) func(idem.Observation) {
		return func(o idem.Observation) {
			v, _ := o.Context.Value(reqKey{}).(string)
			mu.Lock()
			*into = append(*into, o.Outcome.String()+":"+v)
			mu.Unlock()
		}
	}
	f := newFixture(t, idem.Options{Observer: idem.Observers(record(&seen), nil, record(&seen2))}, nil)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mw.Handler(f.inner).ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), reqKey{}, "http")))
	}))
	t.Cleanup(srv.Close)
	for range 3 { // new, replayed from the database, replayed from memory
		require.Equal(t, http.StatusCreated, f.sendTo(srv.URL, "evt_ctx", `{}`).status)
	}
	_, err := f.mw.Do(context.WithValue(context.Background(), reqKey{}, "do"), idem.Key{Source: "test", EventID: "do_ctx"}, nil,
		func(context.Context) ([]byte, error) { return []byte("ok"), nil })
	require.NoError(t, err)
	want := []string{"completed:http", "replayed:http", "replayed:http", "completed:do"}
	assert.Equal(t, want, seen)
	assert.Equal(t, want, seen2)
	s := f.mw.Stats()
	assert.Equal(t, 1, s.ReplayCacheEntries)
	assert.Positive(t, s.ReplayCacheBytes)
	assert.Zero(t, s.WaitingInMemory)
}
