// Package idemgin puts idem's middleware in front of gin handlers.
//
//	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe()}) // or idempgx.New(pool, ...)
//	...
//	hooks := router.Group("/webhooks", idemgin.Wrap(mw.Handler))
//	hooks.POST("/stripe", func(c *gin.Context) {
//		tx, ok := idem.Tx(c.Request.Context()) // idempgx.Tx with idempgx
//		...
//		c.JSON(http.StatusCreated, gin.H{"ok": true})
//	})
//
// Whatever the handlers after Wrap do — c.JSON, c.Status, c.AbortWithStatus,
// c.AbortWithStatusJSON, an error rendered by a middleware after Wrap — is
// buffered, and the client receives exactly the answer idem committed (a
// final status) or rolled back (any other), never a 2xx for something
// rolled back. A panic goes on to gin.Recovery (put it before Wrap), after
// idem has rolled back. A middleware before Wrap that writes after the
// chain returns (an error renderer that reads c.Errors) writes too late:
// idem has already answered; render errors after Wrap instead.
package idemgin

import (
	"bufio"
	"errors"
	"net"
	"net/http"

	"github.com/gin-gonic/gin"
)

// Wrap turns an idem middleware's Handler method (of idem.New's or
// idempgx.New's Middleware) into gin middleware: the rest of the chain
// runs inside it, in the claim's transaction.
func Wrap(handler func(http.Handler) http.Handler) gin.HandlerFunc {
	return func(c *gin.Context) {
		orig := c.Writer
		defer func() { c.Writer = orig }() // also when a handler panics: gin.Recovery answers on the real writer
		ran := false
		inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ran = true
			bw := &writer{w: w, status: http.StatusOK}
			c.Request = r
			c.Writer = bw
			c.Next()
			// A status set without a body (c.Status, c.AbortWithStatus) is
			// sent now, to idem's buffer, as gin would send it to the client.
			bw.WriteHeaderNow()
		})
		handler(inner).ServeHTTP(orig, c.Request)
		if !ran {
			c.Abort() // idem answered by itself: a replay, 4xx, 409 or 503
		}
	}
}

// writer is the gin.ResponseWriter of the handlers after Wrap: it writes
// into idem's buffered writer, with gin's bookkeeping (the status waits
// until the first write or WriteHeaderNow, as gin's own writer does).
type writer struct {
	w       http.ResponseWriter
	status  int
	size    int
	written bool
}

var _ gin.ResponseWriter = (*writer)(nil)

func (w *writer) Header() http.Header { return w.w.Header() }

// WriteHeader records the status; it is sent with the first write.
func (w *writer) WriteHeader(code int) {
	if code > 0 && !w.written {
		w.status = code
	}
}

// WriteHeaderNow sends the recorded status to idem's writer.
func (w *writer) WriteHeaderNow() {
	if !w.written {
		w.written = true
		w.w.WriteHeader(w.status)
	}
}

func (w *writer) Write(b []byte) (int, error) {
	w.WriteHeaderNow()
	n, err := w.w.Write(b)
	w.size += n
	return n, err
}

func (w *writer) WriteString(s string) (int, error) { return w.Write([]byte(s)) }

func (w *writer) Status() int { return w.status }

// Size is the number of body bytes written, -1 before anything was.
func (w *writer) Size() int {
	if !w.written {
		return -1
	}
	return w.size
}

func (w *writer) Written() bool { return w.written }

// Flush does nothing: idem sends the answer after commit.
func (w *writer) Flush() {}

// Hijack is refused: a hijacked connection cannot be made idempotent.
func (w *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errors.New("idem: hijacking is not supported under the idempotency middleware")
}

// CloseNotify returns a channel that never fires: the handler's work is
// not tied to the client's connection (see idem.Options.HandlerTimeout).
func (w *writer) CloseNotify() <-chan bool { return make(chan bool) }

// Pusher is nil: nothing is pushed from a buffered answer.
func (w *writer) Pusher() http.Pusher { return nil }

// Unwrap returns idem's writer, for http.ResponseController.
func (w *writer) Unwrap() http.ResponseWriter { return w.w }
