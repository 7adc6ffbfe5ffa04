package idem_test

import (
	"database/sql/driver"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/DATA-DOG/go-sqlmock"
	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// go-sqlmock drives the failure paths a real server will not produce on
// demand at a chosen statement: BEGIN, the claim, the UPDATE, COMMIT.

var errDriver = errors.New("driver: connection reset by peer at 10.1.2.3:5432")

// wonRow is the claim's answer for a new key.
func wonRow() *sqlmock.Rows {
	return sqlmock.NewRows([]string{"bool"}).AddRow(true)
}

type mockCase struct {
	mock sqlmock.Sqlmock
	h    http.Handler
	runs int
}

func newMockCase(t *testing.T) *mockCase {
	t.Helper()
	db, mock, err := sqlmock.New(sqlmock.QueryMatcherOption(sqlmock.QueryMatcherRegexp))
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id")})
	require.NoError(t, err)
	// The first claim asks whether the table is partitioned, and whether
	// Citus is installed: neither.
	mock.ExpectQuery(`relkind = 'p'`).WithArgs(`"webhook_idempotency"`).
		WillReturnRows(sqlmock.NewRows([]string{"partitioned", "citus"}).AddRow(false, false))
	c := &mockCase{mock: mock}
	c.h = mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.runs++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ledger_id": 1}`))
	}))
	return c
}

func (c *mockCase) serve(w http.ResponseWriter) {
	req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader(`{"amount": 1}`))
	req.Header.Set("X-Event-Id", "evt_1")
	c.h.ServeHTTP(w, req)
}

func TestStoreFailuresAre503WithRetryAfter(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		expect  func(m sqlmock.Sqlmock)
		handler bool // whether the handler ran before the failure
	}{
		{"BEGIN fails", func(m sqlmock.Sqlmock) {
			m.ExpectBegin().WillReturnError(errDriver)
		}, false},
		{"the claim fails", func(m sqlmock.Sqlmock) {
			m.ExpectBegin()
			m.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnError(errDriver)
			m.ExpectRollback()
		}, false},
		{"storing the response fails", func(m sqlmock.Sqlmock) {
			m.ExpectBegin()
			m.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnRows(wonRow())
			m.ExpectExec(`UPDATE "webhook_idempotency"`).WillReturnError(errDriver)
			m.ExpectRollback()
		}, true},
		{"storing the response updates no row", func(m sqlmock.Sqlmock) {
			m.ExpectBegin()
			m.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnRows(wonRow())
			m.ExpectExec(`UPDATE "webhook_idempotency"`).WillReturnResult(sqlmock.NewResult(0, 0))
			m.ExpectRollback()
		}, true},
		{"COMMIT fails", func(m sqlmock.Sqlmock) {
			m.ExpectBegin()
			m.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnRows(wonRow())
			m.ExpectExec(`UPDATE "webhook_idempotency"`).WillReturnResult(sqlmock.NewResult(0, 1))
			m.ExpectCommit().WillReturnError(errDriver)
		}, true},
		{"the connection breaks at COMMIT", func(m sqlmock.Sqlmock) {
			m.ExpectBegin()
			m.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnRows(wonRow())
			m.ExpectExec(`UPDATE "webhook_idempotency"`).WillReturnResult(sqlmock.NewResult(0, 1))
			m.ExpectCommit().WillReturnError(driver.ErrBadConn)
		}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newMockCase(t)
			tc.expect(c.mock)
			w := httptest.NewRecorder()
			c.serve(w)
			assert.Equal(t, http.StatusServiceUnavailable, w.Code)
			assert.Equal(t, "1", w.Header().Get("Retry-After"))
			assert.Equal(t, "application/problem+json", w.Header().Get("Content-Type"))
			assert.NotContains(t, w.Body.String(), "ledger_id", "the buffered 2xx is dropped")
			assert.NotContains(t, w.Body.String(), "10.1.2.3", "no internal error text")
			assert.Equal(t, tc.handler, c.runs == 1)
			assert.NoError(t, c.mock.ExpectationsWereMet())
		})
	}
}

// commitProbe is a ResponseWriter that records whether the transaction had
// committed when the first byte of the answer was written.
type commitProbe struct {
	*httptest.ResponseRecorder
	mock        sqlmock.Sqlmock
	metAtHeader error
	called      bool
}

func (p *commitProbe) WriteHeader(code int) {
	if !p.called {
		p.called = true
		p.metAtHeader = p.mock.ExpectationsWereMet()
	}
	p.ResponseRecorder.WriteHeader(code)
}

func TestAnswerIsSentOnlyAfterCommit(t *testing.T) {
	t.Parallel()
	c := newMockCase(t)
	c.mock.ExpectBegin()
	c.mock.ExpectQuery(`INSERT INTO "webhook_idempotency"`).WillReturnRows(wonRow())
	c.mock.ExpectExec(`UPDATE "webhook_idempotency"`).
		WithArgs("test", "evt_1", http.StatusCreated, `{"Content-Type":["application/json"]}`, []byte(`{"ledger_id": 1}`)).
		WillReturnResult(sqlmock.NewResult(0, 1))
	c.mock.ExpectCommit()
	p := &commitProbe{ResponseRecorder: httptest.NewRecorder(), mock: c.mock}
	c.serve(p)
	require.True(t, p.called)
	assert.NoError(t, p.metAtHeader, "BEGIN, claim, store and COMMIT all happened before the status was written")
	assert.Equal(t, http.StatusCreated, p.Code)
	assert.Equal(t, `{"ledger_id": 1}`, p.Body.String())
}
