package main

import (
	"database/sql"
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgin"
)

// newRouter serves GET /healthz, and POST /webhooks/stripe through the
// idempotency middleware.
func newRouter(db *sql.DB) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe()})
	if err != nil {
		return nil, err
	}
	r := gin.New()
	r.Use(gin.Recovery()) // before Wrap: a panic reaches it after idem rolled back
	r.GET("/healthz", func(c *gin.Context) { c.String(http.StatusOK, "ok") })
	hooks := r.Group("/webhooks", idemgin.Wrap(mw.Handler)) // the webhook routes only
	hooks.POST("/stripe", recordPayment)
	return r, nil
}

// event is the part of a Stripe payment_intent event this receiver uses.
type event struct {
	Type string `json:"type"`
	Data struct {
		Object struct {
			ID     string `json:"id"`
			Amount int64  `json:"amount"`
		} `json:"object"`
	} `json:"data"`
}

// recordPayment records the payment in the transaction that holds the
// claim: a redelivered event is answered from the stored reply, and the
// payment is recorded once.
func recordPayment(c *gin.Context) {
	var ev event
	if err := c.ShouldBindJSON(&ev); err != nil || ev.Data.Object.ID == "" {
		// Not 2xx: rolled back, nothing stored; the client gets this 400.
		c.AbortWithStatusJSON(http.StatusBadRequest, gin.H{"error": "not a payment event"})
		return
	}
	if ev.Type != "payment_intent.succeeded" {
		c.JSON(http.StatusOK, gin.H{"ignored": ev.Type}) // stored and replayed too
		return
	}
	tx, ok := idem.Tx(c.Request.Context())
	if !ok {
		c.AbortWithStatus(http.StatusInternalServerError)
		return
	}
	var id int64
	err := tx.QueryRowContext(c.Request.Context(),
		`INSERT INTO payments (payment_intent, amount) VALUES ($1, $2) RETURNING id`,
		ev.Data.Object.ID, ev.Data.Object.Amount).Scan(&id)
	if err != nil {
		c.AbortWithStatusJSON(http.StatusServiceUnavailable, gin.H{"error": "try again"}) // rolled back
		return
	}
	c.JSON(http.StatusCreated, gin.H{"payment": id})
}
