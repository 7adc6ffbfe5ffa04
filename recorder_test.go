package idem

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRecorderFirstFinalStatusWins(t *testing.T) {
	rec := newRecorder(httptest.NewRecorder(), 100)
	rec.WriteHeader(http.StatusContinue) // informational: ignored
	rec.WriteHeader(http.StatusAccepted)
	rec.WriteHeader(http.StatusInternalServerError)
	assert.Equal(t, http.StatusAccepted, rec.finalStatus())
}

func TestRecorderWriteBeforeWriteHeaderMeans200(t *testing.T) {
	rec := newRecorder(httptest.NewRecorder(), 100)
	n, err := rec.Write([]byte("hello"))
	require.NoError(t, err)
	assert.Equal(t, 5, n)
	rec.WriteHeader(http.StatusTeapot)
	assert.Equal(t, http.StatusOK, rec.finalStatus())
	assert.Equal(t, "hello", rec.body.String())
}

func TestRecorderWithoutWritesIs200(t *testing.T) {
	assert.Equal(t, http.StatusOK, newRecorder(httptest.NewRecorder(), 1).finalStatus())
}

func TestRecorderInvalidStatusPanicsLikeNetHTTP(t *testing.T) {
	assert.Panics(t, func() { newRecorder(httptest.NewRecorder(), 1).WriteHeader(42) })
}

func TestRecorderNothingReachesTheClient(t *testing.T) {
	under := httptest.NewRecorder()
	rec := newRecorder(under, 100)
	rec.Header().Set("X-Handler", "1")
	rec.WriteHeader(http.StatusCreated)
	_, _ = rec.Write([]byte("buffered"))
	rec.Flush()
	require.NoError(t, http.NewResponseController(rec).Flush())
	assert.False(t, under.Flushed, "Flush does not leak bytes before commit")
	assert.Empty(t, under.Body.String())
	assert.Empty(t, under.Header().Get("X-Handler"), "headers stay on the recorder")
	assert.Equal(t, http.StatusOK, under.Code, "the real writer was never written")
}

func TestRecorderHeaderStartsFromTheOuterWriter(t *testing.T) {
	under := httptest.NewRecorder()
	under.Header().Set("X-Request-Id", "r1")
	rec := newRecorder(under, 100)
	assert.Equal(t, "r1", rec.Header().Get("X-Request-Id"))
	rec.Header().Del("X-Request-Id")
	assert.Equal(t, "r1", under.Header().Get("X-Request-Id"), "a copy, not the same map")
}

func TestRecorderHijackFails(t *testing.T) {
	rec := newRecorder(httptest.NewRecorder(), 100)
	_, _, err := rec.Hijack()
	assert.ErrorIs(t, err, ErrHijack)
	_, _, err = http.NewResponseController(rec).Hijack()
	assert.ErrorIs(t, err, ErrHijack, "ResponseController finds the recorder's Hijack first")
}

// deadlineWriter records SetWriteDeadline, which ResponseController reaches
// through Unwrap.
type deadlineWriter struct {
	*httptest.ResponseRecorder
	deadline time.Time
}

func (d *deadlineWriter) SetWriteDeadline(t time.Time) error { d.deadline = t; return nil }

func TestRecorderUnwrapReachesTheRealWriter(t *testing.T) {
	under := &deadlineWriter{ResponseRecorder: httptest.NewRecorder()}
	rec := newRecorder(under, 100)
	assert.Same(t, under, rec.Unwrap())
	when := time.Unix(1700000000, 0)
	require.NoError(t, http.NewResponseController(rec).SetWriteDeadline(when))
	assert.Equal(t, when, under.deadline)
	err := http.NewResponseController(rec).SetReadDeadline(when)
	assert.True(t, errors.Is(err, http.ErrNotSupported), "what the real writer lacks stays unsupported")
}

func TestRecorderCapsTheResponse(t *testing.T) {
	rec := newRecorder(httptest.NewRecorder(), 8)
	_, err := rec.Write([]byte("12345678"))
	require.NoError(t, err)
	n, err := rec.Write([]byte("9"))
	assert.ErrorIs(t, err, ErrResponseTooLarge)
	assert.Zero(t, n)
	assert.True(t, rec.overflow)
	_, err = rec.WriteString("")
	assert.ErrorIs(t, err, ErrResponseTooLarge, "stays over the cap")
	assert.Equal(t, "12345678", rec.body.String())
}

func TestRecorderIsDeadAfterRelease(t *testing.T) {
	rec := newRecorder(httptest.NewRecorder(), 100)
	_, _ = rec.Write([]byte("answer"))
	lates := 0
	rec.onLate = func() { lates++ }
	rec.release()
	n, err := rec.Write([]byte("late"))
	assert.ErrorIs(t, err, ErrWriteAfterReturn)
	assert.Zero(t, n)
	rec.WriteHeader(http.StatusInternalServerError)
	_, err = rec.WriteString("late")
	assert.ErrorIs(t, err, ErrWriteAfterReturn)
	rec.Header().Set("X-Late", "1") // harmless: nobody reads this map any more
	assert.Equal(t, 1, lates, "reported once")
	assert.Nil(t, rec.body, "the buffer went back to the pool, out of reach")
}
