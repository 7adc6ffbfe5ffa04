package main

import (
	"database/sql"
	"encoding/json"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/pgidem/idem"
)

// newServer returns the echo server: POST /webhooks/billing under the
// idempotency middleware, and GET /healthz, outside it.
func newServer(db *sql.DB) (*echo.Echo, error) {
	mw, err := newMiddleware(db)
	if err != nil {
		return nil, err
	}
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.GET("/healthz", func(c echo.Context) error { return c.String(http.StatusOK, "ok\n") })
	// The middleware on the webhook group only. renderErrors must come
	// after WrapMiddleware, inside it; see its doc.
	hooks := e.Group("/webhooks", echo.WrapMiddleware(mw.Handler), renderErrors)
	hooks.POST("/billing", invoicePaid)
	return e, nil
}

func newMiddleware(db *sql.DB) (*idem.Middleware, error) {
	return idem.New(db, idem.Options{KeyFunc: idem.StandardWebhooks("billing")})
}

// renderErrors writes the answer of an error that a handler returns, inside
// the idempotency middleware.
//
// Echo renders returned errors after the whole middleware chain has
// returned, that is after echo.WrapMiddleware's http.Handler has already
// seen the handler finish having written nothing. Without this, the
// middleware would take that for an empty 200, commit the handler's writes
// and store the empty answer, and echo's error page would go nowhere. With
// it, the error's status is what the middleware sees: not 2xx, so it rolls
// back, and the sender's retry runs again.
func renderErrors(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if err := next(c); err != nil {
			c.Error(err)
		}
		return nil
	}
}

// invoiceEvent is the payload of an invoice.paid webhook.
type invoiceEvent struct {
	Type string `json:"type"`
	Data struct {
		Account string `json:"account"`
		Invoice string `json:"invoice"`
		Amount  int64  `json:"amount"`
	} `json:"data"`
}

// invoicePaid records the payment and credits the account, in the
// transaction that holds the claim, which echo hands over in
// c.Request().Context().
func invoicePaid(c echo.Context) error {
	ctx := c.Request().Context()
	tx, ok := idem.Tx(ctx)
	if !ok {
		return echo.NewHTTPError(http.StatusInternalServerError, "not behind the idempotency middleware")
	}
	var ev invoiceEvent
	if err := json.NewDecoder(c.Request().Body).Decode(&ev); err != nil || ev.Type != "invoice.paid" || ev.Data.Amount <= 0 {
		return echo.NewHTTPError(http.StatusBadRequest, "not an invoice.paid event")
	}
	var paymentID, balance int64
	err := tx.QueryRowContext(ctx, `INSERT INTO invoice_payments (account, invoice, amount) VALUES ($1, $2, $3) RETURNING id`,
		ev.Data.Account, ev.Data.Invoice, ev.Data.Amount).Scan(&paymentID)
	if err != nil {
		return echo.NewHTTPError(http.StatusServiceUnavailable, "cannot record the payment")
	}
	err = tx.QueryRowContext(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
		ev.Data.Account, ev.Data.Amount).Scan(&balance)
	switch {
	case err == sql.ErrNoRows:
		// The payment row above is rolled back with the claim.
		return echo.NewHTTPError(http.StatusNotFound, "no such account")
	case err != nil:
		return echo.NewHTTPError(http.StatusServiceUnavailable, "cannot credit the account")
	}
	return c.JSON(http.StatusOK, map[string]any{"payment_id": paymentID, "balance": balance})
}
