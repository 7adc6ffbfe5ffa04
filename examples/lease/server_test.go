package main

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

const order = `{"customer":"cus_1","amount":1999}`

// setup returns a migrated test database and a running fake payment API.
func setup(t *testing.T) (*sql.DB, *paymentAPI, *httptest.Server) {
	t.Helper()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	api := newPaymentAPI()
	payments := httptest.NewServer(api)
	t.Cleanup(payments.Close)
	return db, api, payments
}

func TestCharge(t *testing.T) {
	t.Parallel()
	db, api, payments := setup(t)
	h, err := newServer(db, &charger{payments: payments.URL, client: payments.Client()}, 10*time.Second)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	first := webhooktest.Post(t, srv.URL+"/charges", order, "Authorization", "Bearer token-a", "Idempotency-Key", `"order-1"`)
	require.Equal(t, http.StatusCreated, first.Status, "%s", first.Body)
	webhooktest.AssertReplay(t, first, webhooktest.Post(t, srv.URL+"/charges", order, "Authorization", "Bearer token-a", "Idempotency-Key", `"order-1"`))
	assert.Equal(t, 1, api.charges())
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM charges`))

	// Keys are scoped by the authenticated client: another client's
	// "order-1" is its own charge, not client_a's replay; without
	// credentials nothing is claimed or charged.
	other := webhooktest.Post(t, srv.URL+"/charges", order, "Authorization", "Bearer token-b", "Idempotency-Key", `"order-1"`)
	require.Equal(t, http.StatusCreated, other.Status, "%s", other.Body)
	assert.Empty(t, other.Header.Get("Idempotent-Replayed"))
	assert.NotEqual(t, first.Body, other.Body)
	anonymous := webhooktest.Post(t, srv.URL+"/charges", order, "Idempotency-Key", `"order-1"`)
	assert.Equal(t, http.StatusUnauthorized, anonymous.Status)
	assert.Equal(t, 2, api.charges())
	assert.Equal(t, 2, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE source IN ('charges:client_a', 'charges:client_b')`))
}

// An original that charged the card and then hung (a crashed or frozen
// process) past its lease: the retry, on another instance, takes the key
// over and calls the payment API again with the same key, which answers
// with the first charge. One card charge, one record, one stored answer;
// the hung original, when it wakes, stores nothing.
func TestTakeoverAfterACrashDoesNotChargeTwice(t *testing.T) {
	t.Parallel()
	db, api, payments := setup(t)
	const lease = time.Second

	hung, wake := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(wake) }) })
	crashing := &charger{payments: payments.URL, client: payments.Client(), afterCharge: func(*http.Request) {
		close(hung)
		<-wake // hangs past its lease, whatever its deadline says
	}}
	h1, err := newServer(db, crashing, lease)
	require.NoError(t, err)
	first := httptest.NewServer(h1)
	t.Cleanup(first.Close)
	h2, err := newServer(db, &charger{payments: payments.URL, client: payments.Client()}, lease)
	require.NoError(t, err)
	second := httptest.NewServer(h2)
	t.Cleanup(second.Close)

	original := make(chan webhooktest.Reply, 1)
	go func() {
		original <- webhooktest.Post(t, first.URL+"/charges", order, "Authorization", "Bearer token-a", "Idempotency-Key", `"order-2"`)
	}()
	<-hung
	require.Equal(t, 1, api.charges(), "the original charged the card")

	// The lease is time: wait (bounded) until the database says it is over.
	deadline := time.Now().Add(5 * lease)
	for webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE lease_until < now()`) == 0 {
		require.True(t, time.Now().Before(deadline), "the lease did not run out")
		time.Sleep(50 * time.Millisecond)
	}
	retry := webhooktest.Post(t, second.URL+"/charges", order, "Authorization", "Bearer token-a", "Idempotency-Key", `"order-2"`)
	require.Equal(t, http.StatusCreated, retry.Status, "taken over: %s", retry.Body)
	assert.Equal(t, 1, api.charges(), "the takeover's call got the first charge back")

	once.Do(func() { close(wake) })
	late := <-original
	assert.NotEqual(t, http.StatusCreated, late.Status, "the hung original stores nothing: %s", late.Body)
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM charges`))
	webhooktest.AssertReplay(t, retry, webhooktest.Post(t, first.URL+"/charges", order, "Authorization", "Bearer token-a", "Idempotency-Key", `"order-2"`))
}
