package main

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/gorilla/mux"

	"github.com/pgidem/idem"
)

// newServer routes POST /webhooks/github through the idempotency middleware.
// gorilla/mux runs a sub-router's middleware only for its matched routes.
func newServer(db *sql.DB) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{
		// X-GitHub-Delivery, scoped by X-GitHub-Hook-ID: every hook that
		// fires for one event gets the same delivery GUID.
		KeyFunc: idem.GitHub(),
	})
	if err != nil {
		return nil, err
	}
	r := mux.NewRouter()
	hooks := r.PathPrefix("/webhooks").Subrouter()
	hooks.Use(mw.Handler)
	hooks.HandleFunc("/github", github).Methods(http.MethodPost)
	return r, nil
}

// push is the part of GitHub's push payload this receiver uses.
type push struct {
	Ref        string `json:"ref"`
	After      string `json:"after"`
	Repository struct {
		FullName string `json:"full_name"`
	} `json:"repository"`
}

// github queues a build for each push, in the transaction that holds the
// claim; it acknowledges other events without doing anything (2xx: stored,
// so their redeliveries are replays too).
func github(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("X-GitHub-Event") != "push" {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	var p push
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil || p.After == "" || p.Repository.FullName == "" {
		http.Error(w, "not a push payload", http.StatusBadRequest)
		return
	}
	tx, ok := idem.Tx(r.Context())
	if !ok {
		http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
		return
	}
	var id int64
	err := tx.QueryRowContext(r.Context(),
		`INSERT INTO builds (repo, ref, sha) VALUES ($1, $2, $3) RETURNING id`,
		p.Repository.FullName, p.Ref, p.After).Scan(&id)
	if err != nil {
		http.Error(w, "cannot queue the build", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"build_id":%d,"sha":%q}`+"\n", id, p.After)
}
