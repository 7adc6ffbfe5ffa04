package idem

import (
	"bufio"
	"bytes"
	"net"
	"net/http"
	"strconv"
	"sync"
)

// recorder is the ResponseWriter the wrapped handler writes to. Nothing
// reaches the client through it: status, headers and body are buffered until
// the middleware has committed (then they are sent) or rolled back (then they
// are dropped).
//
// It follows net/http's rules: the first final status wins, 1xx statuses are
// ignored (they cannot be sent before the outcome is known), Write before
// WriteHeader means 200. Flush is a no-op, Hijack fails, and Unwrap exposes
// the real writer to http.ResponseController for what is safe to reach
// (deadlines, full duplex): ResponseController finds Flush and Hijack here
// first.
type recorder struct {
	header      http.Header
	status      int
	wroteHeader bool
	body        *bytes.Buffer // from bufferPool; nil once released
	limit       int
	overflow    bool // the handler wrote more than limit bytes
	under       http.ResponseWriter
	released    bool   // the answer is out: the recorder is dead
	onLate      func() // called once if the handler writes after that
}

func newRecorder(under http.ResponseWriter, limit int) *recorder {
	return &recorder{header: under.Header().Clone(), body: getBuffer(), under: under, limit: limit}
}

// release gives the body buffer back to the pool once the answer has been
// sent (and copied where it is kept). The recorder itself is never reused:
// a caller that keeps the writer after ServeHTTP returns (echo's
// WrapMiddleware does, to render a returned error) writes into a dead
// recorder, never into another request's answer.
func (rec *recorder) release() {
	putBuffer(rec.body)
	rec.retire()
}

// retire ends the recorder like release, but leaves the body buffer to the
// garbage collector: a COMMIT that outlived its request still reads it.
func (rec *recorder) retire() {
	rec.body = nil
	rec.released = true
}

// late reports a write after release: the answer was already decided.
func (rec *recorder) late() error {
	if rec.onLate != nil {
		rec.onLate()
		rec.onLate = nil
	}
	return ErrWriteAfterReturn
}

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(code int) {
	if rec.released {
		_ = rec.late()
		return
	}
	if rec.wroteHeader {
		return
	}
	if code < 100 || code > 999 {
		// net/http panics here; keep its behaviour so the bug is seen.
		panic("idem: invalid WriteHeader code " + strconv.Itoa(code))
	}
	if code < 200 {
		return // informational: dropped, the final answer comes after commit
	}
	rec.status = code
	rec.wroteHeader = true
}

func (rec *recorder) Write(p []byte) (int, error) {
	if err := rec.room(len(p)); err != nil {
		return 0, err
	}
	return rec.body.Write(p)
}

// WriteString lets io.WriteString avoid a conversion.
func (rec *recorder) WriteString(s string) (int, error) {
	if err := rec.room(len(s)); err != nil {
		return 0, err
	}
	return rec.body.WriteString(s)
}

// room prepares a write of n bytes: the implicit 200, and the checks that
// the recorder is alive and the answer stays under its cap.
func (rec *recorder) room(n int) error {
	if rec.released {
		return rec.late()
	}
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.overflow {
		return ErrResponseTooLarge
	}
	if rec.body.Len()+n > rec.limit {
		rec.overflow = true
		return ErrResponseTooLarge
	}
	return nil
}

// Flush does nothing: bytes sent before COMMIT could promise a result that
// is then rolled back.
func (rec *recorder) Flush() {}

// FlushError is what http.ResponseController.Flush calls; it reports success
// without sending anything, for the same reason as Flush.
func (rec *recorder) FlushError() error { return nil }

// Hijack refuses: a hijacked connection bypasses the buffered answer.
func (rec *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, ErrHijack
}

// Unwrap returns the real ResponseWriter for http.ResponseController.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.under }

// finalStatus is the status the handler answered, 200 if it wrote nothing.
func (rec *recorder) finalStatus() int {
	if !rec.wroteHeader {
		return http.StatusOK
	}
	return rec.status
}

// maxPooledBuffer is the largest buffer kept for reuse: request bodies and
// answers of webhooks are mostly small, and a pool of large buffers would
// hold memory that a burst of big requests once needed.
const maxPooledBuffer = 64 << 10

var bufferPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func getBuffer() *bytes.Buffer { return bufferPool.Get().(*bytes.Buffer) }

func putBuffer(b *bytes.Buffer) {
	if b.Cap() > maxPooledBuffer {
		return
	}
	b.Reset()
	bufferPool.Put(b)
}
