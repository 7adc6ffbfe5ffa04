// Command idem imports the idem package and nothing else outside the
// standard library: a program that uses only the package must build from
// the root module alone.
package main

import (
	"net/http"

	"github.com/pgidem/idem"
)

func main() {
	mw, err := idem.New(offlineDB(), options())
	check(err)
	refuse("idem", mw.Handler(http.NotFoundHandler()))
}
