package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/pgidem/idem"
)

// This file is copied next to each program's main.go.

// offline never connects.
type offline struct{}

func (offline) Connect(context.Context) (driver.Conn, error) { return nil, errors.New("offline") }
func (offline) Driver() driver.Driver                        { return nil }

// offlineDB returns a *sql.DB that never connects: the requests the
// programs send are refused before any claim.
func offlineDB() *sql.DB {
	db := sql.OpenDB(offline{})
	db.SetMaxOpenConns(1)
	return db
}

// options are Stripe keys and no logs.
func options() idem.Options {
	return idem.Options{KeyFunc: idem.Stripe(), Logger: slog.New(slog.DiscardHandler)}
}

// refuse sends h a Stripe event without an id, which the middleware answers
// with 400 before any claim, prints the answer, and exits 1 if it is not
// that.
func refuse(name string, h http.Handler) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/webhooks/stripe", strings.NewReader(`{}`)))
	fmt.Println(name+":", rec.Code, rec.Header().Get("Content-Type"))
	if rec.Code != http.StatusBadRequest {
		os.Exit(1)
	}
}

// check exits 1 on err.
func check(err error) {
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
}
