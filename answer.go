package idem

import (
	"log/slog"
	"strconv"
)

// replay answers a duplicate with the stored response. Headers set by
// middleware outside this one stay; the stored ones are laid over them.
func (x *exchange) replay(s *stored) {
	if x.call != nil {
		x.replayDo(s)
		return
	}
	dst := x.w.Header()
	for k, v := range s.header {
		dst[k] = append([]string(nil), v...) // the cache keeps its own
	}
	dst.Set("Idempotent-Replayed", "true")
	x.obs.Outcome = OutcomeReplayed
	x.send(s.status, s.body)
}

// answer sends the handler's own answer, after commit or rollback: the
// client sees exactly the headers the handler left on its writer.
func (x *exchange) answer(rec *recorder) {
	dst := x.w.Header()
	for k := range dst {
		if _, keep := rec.header[k]; !keep {
			delete(dst, k)
		}
	}
	for k, v := range rec.header {
		dst[k] = v
	}
	x.send(rec.finalStatus(), rec.body.Bytes())
}

// send writes the answer; the trailers in the header (a gRPC answer's
// grpc-status) are declared before the body and set after it, so net/http
// sends them as trailers.
func (x *exchange) send(status int, body []byte) {
	h := x.w.Header()
	trailers := takeTrailers(h)
	if trailers == nil {
		h.Set("Content-Length", strconv.Itoa(len(body)))
	} else { // with one, HTTP/1.1 must chunk to send it
		h.Del("Content-Length")
	}
	x.obs.Status = status
	x.observe()
	x.w.WriteHeader(status)
	_, _ = x.w.Write(body)
	for k, vs := range trailers {
		h[k] = vs
	}
}

// fail answers with the middleware's own error; a call of Do returns
// p.Err.
func (x *exchange) fail(o Outcome, p *Problem) {
	p.Key = x.obs.Key
	if x.call == nil && p.retryable() {
		x.w.Header().Set("Retry-After", x.m.retryAfterHeader(p))
	}
	x.obs.Outcome, x.obs.Status, x.obs.Err = o, p.Status, p.Err
	level := slog.LevelInfo
	switch o {
	case OutcomeStoreError, OutcomeRolledBack:
		level = slog.LevelError
	}
	x.m.log(x, level, p.Title, p.Err)
	x.observe()
	if x.call != nil {
		x.call.err = p.Err
		if Retryable(p.Err) {
			x.call.res.RetryAfter = max(x.m.retryAfterMin, p.leaseLeft)
		}
		return
	}
	x.m.errorHandler(x.w, x.r, p)
}
