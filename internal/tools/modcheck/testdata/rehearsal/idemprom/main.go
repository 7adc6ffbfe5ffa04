// Command idemprom counts the middleware's outcomes with idemprom.
package main

import (
	"net/http"
	"strings"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func main() {
	reg := prometheus.NewRegistry()
	metrics, err := idemprom.New(reg, idemprom.Options{})
	check(err)
	opts := options()
	opts.Observer = metrics.Observe
	mw, err := idem.New(offlineDB(), opts)
	check(err)
	refuse("idemprom", mw.Handler(http.NotFoundHandler()))
	const want = `
# HELP idem_requests_total Requests handled by the idempotency middleware, by key source, outcome and HTTP status code.
# TYPE idem_requests_total counter
idem_requests_total{code="400",outcome="rejected",source=""} 1
`
	check(testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_requests_total"))
}
