// Command idemgin mounts the middleware in a gin router through idemgin.
package main

import (
	"net/http"

	"github.com/gin-gonic/gin"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgin"
)

func main() {
	gin.SetMode(gin.ReleaseMode)
	mw, err := idem.New(offlineDB(), options())
	check(err)
	r := gin.New()
	r.Group("/webhooks", idemgin.Wrap(mw.Handler)).POST("/stripe", func(c *gin.Context) { c.Status(http.StatusOK) })
	refuse("idemgin", r)
}
