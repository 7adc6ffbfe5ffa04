package main

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"

	"github.com/pgidem/idem"
)

// newServer routes POST /webhooks/{source} for the given sources through the
// idempotency middleware to receive.
//
// The middleware wraps the route's handler, not the whole mux: the mux has
// matched the route by the time the KeyFunc runs, so r.PathValue("source")
// is set.
func newServer(db *sql.DB, sources ...string) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{KeyFunc: keyByRoute(sources...)})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/{source}", mw.Handler(http.HandlerFunc(receive)))
	return mux, nil
}

// keyByRoute is a custom KeyFunc built from a preset: the source comes from
// the route, the event id from the X-Event-Id header. Only known sources are
// accepted, so a caller cannot invent new key scopes at will.
func keyByRoute(sources ...string) idem.KeyFunc {
	bySource := make(map[string]idem.KeyFunc, len(sources))
	for _, s := range sources {
		bySource[s] = idem.Header(s, "X-Event-Id")
	}
	return func(r *http.Request, body []byte) (idem.Key, error) {
		keyFunc, ok := bySource[r.PathValue("source")]
		if !ok {
			// Wrapping ErrInvalidKey: 400, with this text as the detail.
			return idem.Key{}, fmt.Errorf("%w: unknown webhook source", idem.ErrInvalidKey)
		}
		return keyFunc(r, body)
	}
}

// receive stores the event in the inbox inside the transaction that holds
// the claim: the row and the claim commit together, or not at all.
func receive(w http.ResponseWriter, r *http.Request) {
	tx, ok := idem.Tx(r.Context())
	if !ok {
		http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
		return
	}
	key, _ := idem.KeyFromContext(r.Context())
	payload, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "cannot read the body", http.StatusBadRequest)
		return
	}
	var id int64
	err = tx.QueryRowContext(r.Context(),
		`INSERT INTO inbox (source, event_id, payload) VALUES ($1, $2, $3) RETURNING id`,
		key.Source, key.EventID, payload).Scan(&id)
	if err != nil {
		// Not 2xx: the middleware rolls back and the sender's retry runs again.
		http.Error(w, "cannot store the event", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	fmt.Fprintf(w, `{"inbox_id":%d,"source":%q,"event_id":%q}`+"\n", id, key.Source, key.EventID)
}
