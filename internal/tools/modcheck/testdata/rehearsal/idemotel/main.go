// Command idemotel wires idemotel into a middleware (the global, no-op
// providers) and sends it a request it refuses before any claim.
package main

import (
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
)

func main() {
	otel, err := idemotel.New()
	check(err)
	opts := options()
	opts.Observer, opts.OnPhase = otel.Observe, otel.OnPhase
	mw, err := idem.New(offlineDB(), opts)
	check(err)
	reg, err := otel.Watch(mw)
	check(err)
	defer func() { check(reg.Unregister()) }()
	refuse("idemotel", mw.Handler(http.NotFoundHandler()))
}
