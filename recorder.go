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
	body        bytes.Buffer
	limit       int
	overflow    bool // the handler wrote more than limit bytes
	under       http.ResponseWriter
}

var recorderPool = sync.Pool{New: func() any { return new(recorder) }}

func newRecorder(under http.ResponseWriter, limit int) *recorder {
	rec := recorderPool.Get().(*recorder)
	rec.header, rec.under, rec.limit = under.Header().Clone(), under, limit
	return rec
}

// release returns the recorder to the pool once its answer has been sent
// (and copied where it is kept); a recorder that grew large is dropped.
func (rec *recorder) release() {
	if rec.body.Cap() > maxPooledBuffer {
		return
	}
	body := rec.body
	body.Reset()
	*rec = recorder{body: body}
	recorderPool.Put(rec)
}

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(code int) {
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
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.overflow {
		return 0, ErrResponseTooLarge
	}
	if rec.body.Len()+len(p) > rec.limit {
		rec.overflow = true
		return 0, ErrResponseTooLarge
	}
	return rec.body.Write(p)
}

// WriteString lets io.WriteString avoid a conversion.
func (rec *recorder) WriteString(s string) (int, error) {
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.overflow {
		return 0, ErrResponseTooLarge
	}
	if rec.body.Len()+len(s) > rec.limit {
		rec.overflow = true
		return 0, ErrResponseTooLarge
	}
	return rec.body.WriteString(s)
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
