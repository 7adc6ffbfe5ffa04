// Command idemprom counts the middleware's outcomes with idemprom.
package main

import (
	"fmt"
	"net/http"
	"os"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
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
	families, err := reg.Gather()
	check(err)
	for _, f := range families {
		for _, m := range f.GetMetric() {
			if f.GetName() == "idem_requests_total" && m.GetCounter().GetValue() == 1 && len(m.GetLabel()) == 3 && m.GetLabel()[1].GetValue() == "rejected" {
				fmt.Println("idemprom: counted as rejected")
				return
			}
		}
	}
	fmt.Println("idemprom: idem_requests_total{outcome=\"rejected\"} is not 1")
	os.Exit(1)
}
