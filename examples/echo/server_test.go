package main

import (
	"context"
	"database/sql"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

const paid = `{"type":"invoice.paid","data":{"account":"acct_1","invoice":"in_1","amount":1200}}`

func newTestDB(t *testing.T) *sql.DB {
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	_, err := db.Exec(`INSERT INTO accounts (id) VALUES ('acct_1')`)
	require.NoError(t, err)
	return db
}

func TestEcho(t *testing.T) {
	t.Parallel()
	db := newTestDB(t)
	e, err := newServer(db)
	require.NoError(t, err)
	srv := httptest.NewServer(e)
	t.Cleanup(srv.Close)
	url := srv.URL + "/webhooks/billing"
	balance := func() int { return webhooktest.Count(t, db, `SELECT balance FROM accounts WHERE id = 'acct_1'`) }

	t.Run("the handler writes through the transaction and a duplicate is replayed", func(t *testing.T) {
		first := webhooktest.Post(t, url, paid, "webhook-id", "msg_1")
		require.Equal(t, http.StatusOK, first.Status, "body: %s", first.Body)
		assert.JSONEq(t, `{"payment_id":1,"balance":1200}`, string(first.Body))
		webhooktest.AssertReplay(t, first, webhooktest.Post(t, url, paid, "webhook-id", "msg_1"))
		// Svix sends svix-id instead of webhook-id: the same key.
		webhooktest.AssertReplay(t, first, webhooktest.Post(t, url, paid, "svix-id", "msg_1"))
		assert.Equal(t, 1200, balance(), "credited once")
		assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM invoice_payments`))
	})

	t.Run("a returned error rolls back the handler's writes", func(t *testing.T) {
		body := `{"type":"invoice.paid","data":{"account":"acct_404","invoice":"in_2","amount":500}}`
		for range 2 {
			r := webhooktest.Post(t, url, body, "webhook-id", "msg_2")
			assert.Equal(t, http.StatusNotFound, r.Status, "body: %s", r.Body)
			assert.JSONEq(t, `{"message":"no such account"}`, string(r.Body), "echo's own error body")
			assert.False(t, r.Replayed(), "not stored: each redelivery runs again")
		}
		assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM invoice_payments`), "the payment insert was rolled back")
		assert.Zero(t, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE event_id = 'msg_2'`))
	})

	t.Run("GET passes through without a key", func(t *testing.T) {
		r := webhooktest.Do(t, http.MethodGet, srv.URL+"/healthz", "")
		assert.Equal(t, http.StatusOK, r.Status)
	})
}

// TestEchoWithoutRenderErrors shows why newServer installs renderErrors:
// with echo.WrapMiddleware alone, a handler that returns an error has its
// writes committed and an empty 200 stored for its key, because echo renders
// the error only after the idempotency middleware has finished. Echo then
// writes its error page to a ResponseWriter whose ServeHTTP has returned;
// what that does depends on the middleware's internals (the page is lost, or
// the write panics and the connection is dropped), so the test checks only
// the database. It does not run in parallel with the other tests, so that a
// late write can never reach a recorder that another request is using.
func TestEchoWithoutRenderErrors(t *testing.T) {
	db := newTestDB(t)
	mw, err := newMiddleware(db)
	require.NoError(t, err)
	e := echo.New()
	e.Use(echo.WrapMiddleware(mw.Handler))
	e.POST("/webhooks/billing", invoicePaid)
	srv := httptest.NewUnstartedServer(e)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the late write's panic, if any
	srv.Start()
	t.Cleanup(srv.Close)

	body := `{"type":"invoice.paid","data":{"account":"acct_404","invoice":"in_2","amount":500}}`
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/webhooks/billing", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("webhook-id", "msg_2")
	if res, err := http.DefaultClient.Do(req); err == nil {
		assert.NotEqual(t, http.StatusNotFound, res.StatusCode, "the 404 the handler returned is lost")
		res.Body.Close()
	}
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM invoice_payments WHERE account = 'acct_404'`),
		"the write before the error committed")
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency
		WHERE event_id = 'msg_2' AND response_status = 200 AND coalesce(length(response_body), 0) = 0`),
		"and an empty 200 is stored: every redelivery gets it")
}
