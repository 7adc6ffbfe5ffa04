package idem

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// bodyReader replays the buffered request body to the handler.
type bodyReader struct{ bytes.Reader }

// Close does nothing: the middleware owns the buffer.
func (*bodyReader) Close() error { return nil }

// initialBodyBuffer bounds the buffer a request body starts with, whatever
// its Content-Length announces: connections that announce large bodies and
// stall commit no more memory than this each.
const initialBodyBuffer = 32 << 10

// readBody reads the whole request body, bounded by MaxBodyBytes.
func (m *Middleware) readBody(r *http.Request, buf *bytes.Buffer) ([]byte, error) {
	if r.ContentLength > m.maxBody {
		return nil, ErrBodyTooLarge
	}
	if r.Body == nil || r.Body == http.NoBody {
		return []byte{}, nil
	}
	if r.ContentLength > 0 {
		// Content-Length is the client's word, not bytes received: a
		// bounded start, then the buffer grows as the bytes arrive (room
		// for the read that finds EOF saves a copy of small bodies).
		buf.Grow(int(min(r.ContentLength+bytes.MinRead, initialBodyBuffer)))
	}
	n, err := buf.ReadFrom(&limitedReader{r: r.Body, n: m.maxBody + 1})
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, ErrBodyTooLarge
		}
		return nil, fmt.Errorf("%w: %w", ErrBodyUnreadable, err)
	}
	if n > m.maxBody {
		return nil, ErrBodyTooLarge
	}
	return buf.Bytes(), nil
}

// limitedReader is io.LimitedReader without its allocation per request.
type limitedReader struct {
	r io.Reader
	n int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}
