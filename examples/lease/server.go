package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/pgidem/idem"
)

// charger serves POST /charges: it charges a card through the payment API
// at payments, then records the charge. The call to the payment API can
// take seconds, so the middleware runs in lease mode: no transaction or
// connection is held during the call.
type charger struct {
	payments string       // the payment API's base URL
	client   *http.Client // for the payment API
	// afterCharge, if set, runs between the charge and its record: the
	// test uses it to make an original hang there, as a crashed or frozen
	// process would.
	afterCharge func(*http.Request)
}

// newServer returns the receiver: POST /charges behind the authentication
// middleware, then the idempotency middleware in lease mode.
func newServer(db *sql.DB, c *charger, lease time.Duration) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{
		KeyFunc: chargeKey,
		Lease:   lease, // HandlerTimeout: four fifths of it
	})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /charges", authenticate(mw.Handler(c)))
	return mux, nil
}

// clients stands for the application's API credentials: bearer token ->
// client id.
var clients = map[string]string{"token-a": "client_a", "token-b": "client_b"}

// clientKey is the context key under which authenticate puts the id of the
// client it verified.
type clientKey struct{}

// authenticate stands for the application's authentication middleware,
// mounted before idem: it verifies the caller's bearer token and puts the
// client's id in the request's context, or answers 401.
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		client, known := clients[token]
		if !ok || !known {
			http.Error(w, "unauthenticated", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), clientKey{}, client)))
	})
}

// chargeKey is the request's Idempotency-Key, scoped by the client that
// authenticate verified, never by anything the client sends: one client
// can never reach another's keys, and two clients may use the same key.
func chargeKey(r *http.Request, _ []byte) (idem.Key, error) {
	client, ok := r.Context().Value(clientKey{}).(string)
	if !ok || client == "" {
		return idem.Key{}, idem.ErrNoKey // not behind authenticate
	}
	id, err := idem.ParseIdempotencyKey(r.Header.Get("Idempotency-Key"))
	if err != nil {
		return idem.Key{}, err
	}
	return idem.Key{Source: "charges:" + client, EventID: id}, nil
}

type chargeRequest struct {
	Customer string `json:"customer"`
	Amount   int64  `json:"amount"`
}

func (c *charger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req chargeRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Customer == "" || req.Amount <= 0 {
		http.Error(w, "want {customer, amount}", http.StatusBadRequest) // releases the key
		return
	}
	key, _ := idem.KeyFromContext(r.Context())
	charge, err := c.charge(r, key, req)
	if err != nil {
		http.Error(w, "payment API unavailable", http.StatusBadGateway) // releases the key: a retry runs
		return
	}
	if c.afterCharge != nil {
		c.afterCharge(r)
	}
	tx, ok := idem.Tx(r.Context()) // the transaction begins here, after the slow call
	if !ok {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
		return
	}
	if _, err := tx.ExecContext(r.Context(), `INSERT INTO charges (charge_id, customer, amount) VALUES ($1, $2, $3)`,
		charge, req.Customer, req.Amount); err != nil {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charge":%q,"amount":%d}`+"\n", charge, req.Amount)
}

// charge calls the payment API with the request's own key as the API's
// Idempotency-Key: a delivery that takes over after a crash repeats the
// call with the same key, and the API answers it with the first charge
// instead of charging again.
func (c *charger) charge(r *http.Request, key idem.Key, req chargeRequest) (string, error) {
	body, _ := json.Marshal(req)
	call, err := http.NewRequestWithContext(r.Context(), http.MethodPost, c.payments+"/v1/charges", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	call.Header.Set("Idempotency-Key", key.Source+"/"+key.EventID)
	res, err := c.client.Do(call)
	if err != nil {
		return "", err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return "", fmt.Errorf("payment API answered %s", res.Status)
	}
	var ch struct{ ID string }
	if err := json.NewDecoder(res.Body).Decode(&ch); err != nil {
		return "", err
	}
	return ch.ID, nil
}
