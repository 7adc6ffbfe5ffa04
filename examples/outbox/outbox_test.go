package main

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

// recordingMailer keeps what it was asked to send.
type recordingMailer struct {
	mu   sync.Mutex
	sent []Email
}

func (m *recordingMailer) Send(_ context.Context, e Email) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sent = append(m.sent, e)
	return nil
}

func (m *recordingMailer) emails() []Email {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Email(nil), m.sent...)
}

func TestOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	require.NoError(t, migrate(ctx, db))
	require.NoError(t, restock(ctx, db, "mug", 5))

	mailer := &recordingMailer{}
	jobs, err := newRiver(db, mailer, slog.New(slog.DiscardHandler), 20*time.Millisecond)
	require.NoError(t, err)
	completed, cancel := jobs.Subscribe(river.EventKindJobCompleted)
	t.Cleanup(cancel)
	require.NoError(t, jobs.Start(ctx))
	t.Cleanup(func() { assert.NoError(t, jobs.Stop(context.Background())) })

	h, err := newServer(db, jobs)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	order := func(key, body string) webhooktest.Reply {
		return webhooktest.Post(t, srv.URL+"/orders", body, "Idempotency-Key", `"`+key+`"`)
	}
	count := func(query string) int { return webhooktest.Count(t, db, query) }

	t.Run("a rolled-back request enqueues nothing", func(t *testing.T) {
		r := order("k-too-many", `{"sku":"mug","quantity":6,"email":"ann@example.com"}`)
		require.Equal(t, http.StatusConflict, r.Status, "body: %s", r.Body)
		assert.JSONEq(t, `{"error":"out of stock"}`, string(r.Body))
		assert.Zero(t, count(`SELECT count(*) FROM river_job`), "the job went with the rollback")
		assert.Zero(t, count(`SELECT count(*) FROM orders`))
	})

	t.Run("an order sends one email however often it is retried", func(t *testing.T) {
		const body = `{"sku":"mug","quantity":2,"email":"jon@example.com"}`
		first := order("k-1", body)
		require.Equal(t, http.StatusCreated, first.Status, "body: %s", first.Body)
		webhooktest.AssertReplay(t, first, order("k-1", body))
		assert.Equal(t, 1, count(`SELECT count(*) FROM river_job`), "one job, enqueued by the first request only")

		// The worker runs the job after commit.
		select {
		case ev := <-completed:
			assert.Equal(t, "order_confirmation_email", ev.Job.Kind)
		case <-time.After(time.Minute):
			t.Fatal("the confirmation job did not complete")
		}
		require.Len(t, mailer.emails(), 1)
		assert.Equal(t, "jon@example.com", mailer.emails()[0].To)

		// A retry after the email went out: still a replay, still one job.
		webhooktest.AssertReplay(t, first, order("k-1", body))
		assert.Equal(t, 1, count(`SELECT count(*) FROM river_job`))
		assert.Equal(t, 1, count(`SELECT count(*) FROM orders`))
		assert.Equal(t, 3, count(`SELECT available FROM stock WHERE sku = 'mug'`), "stock taken once")
	})

	t.Run("the failed request's key was not stored: its retry runs again", func(t *testing.T) {
		r := order("k-too-many", `{"sku":"mug","quantity":6,"email":"ann@example.com"}`)
		assert.Equal(t, http.StatusConflict, r.Status)
		assert.False(t, r.Replayed())
		assert.Equal(t, 1, count(`SELECT count(*) FROM river_job`))
	})
	assert.Len(t, mailer.emails(), 1)
}
