package idem_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
)

// echo.WrapMiddleware keeps the handler's ResponseWriter and renders a
// returned error into it after the middleware's ServeHTTP has returned.
// Such late writes must never reach another request's answer: run many
// requests at once, each followed by a late write, under -race.
func TestLateWritesNeverReachAnotherRequest(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	var kept sync.Map // request id -> the writer the handler saw
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kept.Store(r.Header.Get("X-Event-Id"), w)
		f.ledgerHandler().ServeHTTP(w, r)
	})
	h := f.mw.Handler(inner)
	const workers, each = 8, 25
	var wg sync.WaitGroup
	for g := 0; g < workers; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				id := fmt.Sprintf("evt_%d_%d", g, i)
				req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{}`))
				req.Header.Set("X-Event-Id", id)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				// The late write, as echo's error handler would do it.
				w, _ := kept.Load(id)
				late := w.(http.ResponseWriter)
				late.Header().Set("Content-Type", "text/html")
				late.WriteHeader(http.StatusInternalServerError)
				_, err := late.Write([]byte("<h1>late</h1>"))
				assert.ErrorIs(t, err, idem.ErrWriteAfterReturn)
				assert.Equal(t, http.StatusCreated, rec.Code)
				assert.Contains(t, rec.Body.String(), `"event":"`+id+`"`)
				assert.NotContains(t, rec.Body.String(), "late")
			}
		}(g)
	}
	wg.Wait()
	assert.Equal(t, workers*each, f.ledgerRows())
}
