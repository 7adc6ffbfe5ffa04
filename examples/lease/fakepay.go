package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
)

// paymentAPI is a stand-in for a payment provider's API: POST /v1/charges
// charges a card, and, like Stripe's, remembers each Idempotency-Key, so a
// request repeated with the same key gets the first one's charge back
// instead of a second charge.
type paymentAPI struct {
	mu      sync.Mutex
	byKey   map[string]string // Idempotency-Key -> charge id
	charged int               // charges actually made
}

func newPaymentAPI() *paymentAPI { return &paymentAPI{byKey: map[string]string{}} }

func (p *paymentAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/charges" {
		http.NotFound(w, r)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
		return
	}
	p.mu.Lock()
	id, seen := p.byKey[key]
	if !seen {
		p.charged++
		id = fmt.Sprintf("ch_%d", p.charged)
		p.byKey[key] = id
	}
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"id": id})
}

// charges is how many cards were really charged.
func (p *paymentAPI) charges() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.charged
}
