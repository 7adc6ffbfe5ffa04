package idemgin_test

import (
	"bytes"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgin"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The tests run against PostgreSQL, in a database of their own (DATABASE_URL,
// default the local server), and fail when it is missing.
var (
	db    *sql.DB
	dbURL string
)

func TestMain(m *testing.M) {
	gin.SetMode(gin.ReleaseMode)
	u, drop, err := createDatabase("idemgin_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemgin tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemgin tests: drop database:", err)
	}
	os.Exit(code)
}

var seq atomic.Int64

// world is one test's tables and router: Recovery, idem through Wrap, and
// the routes that build adds.
type world struct {
	t      *testing.T
	table  string
	ledger string
	srv    *httptest.Server
	runs   atomic.Int64
}

func newWorld(t *testing.T, build func(w *world, r *gin.Engine, hooks *gin.RouterGroup)) *world {
	t.Helper()
	return newWorldWith(t, func(w *world, wrap gin.HandlerFunc) *gin.Engine {
		r := gin.New()
		r.Use(gin.Recovery())
		build(w, r, r.Group("/webhooks", wrap))
		return r
	})
}

// newWorldWith is newWorld where build places Wrap's middleware itself.
func newWorldWith(t *testing.T, build func(w *world, wrap gin.HandlerFunc) *gin.Engine) *world {
	t.Helper()
	n := seq.Add(1)
	w := &world{t: t, table: fmt.Sprintf("keys_%d", n), ledger: fmt.Sprintf("ledger_%d", n)}
	require.NoError(t, idem.Migrate(t.Context(), db, w.table))
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (id bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: w.table, Logger: discard()})
	require.NoError(t, err)
	w.srv = httptest.NewServer(build(w, idemgin.Wrap(mw.Handler)))
	t.Cleanup(w.srv.Close)
	return w
}

// write appends the event to the ledger in idem's transaction.
func (w *world) write(c *gin.Context) {
	w.runs.Add(1)
	tx, ok := idem.Tx(c.Request.Context())
	require.True(w.t, ok)
	key, _ := idem.KeyFromContext(c.Request.Context())
	_, err := tx.ExecContext(c.Request.Context(), `INSERT INTO `+w.ledger+` (event_id) VALUES ($1)`, key.EventID)
	require.NoError(w.t, err)
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

func (w *world) post(path, id string) reply {
	w.t.Helper()
	req, err := http.NewRequest(http.MethodPost, w.srv.URL+path, bytes.NewBufferString(`{"n":1}`))
	require.NoError(w.t, err)
	req.Header.Set("X-Event-Id", id)
	// A fresh connection each time: a server whose handler wrote past its
	// Content-Length (the too-late renderer) closes the connection after
	// answering, and a reused one could be reset under the next request.
	req.Close = true
	res, err := http.DefaultClient.Do(req)
	require.NoError(w.t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(w.t, err)
	return reply{res.StatusCode, res.Header, b}
}

func (w *world) count(table string) int {
	var n int
	require.NoError(w.t, db.QueryRow(`SELECT count(*) FROM "`+table+`"`).Scan(&n))
	return n
}

// TestWhatTheClientGetsIsWhatIdemDecided: for each way a gin handler
// answers, the client receives exactly the status idem committed or rolled
// back: a final answer is committed with the write and replayed; any other
// rolls the write back, reaches the client as the handler set it, and the
// redelivery runs again.
func TestWhatTheClientGetsIsWhatIdemDecided(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		answer func(c *gin.Context)
		want   int
		final  bool
	}{
		{"c.JSON 201", func(c *gin.Context) { c.JSON(http.StatusCreated, gin.H{"ok": true}) }, http.StatusCreated, true},
		{"c.Status 204 without a body", func(c *gin.Context) { c.Status(http.StatusNoContent) }, http.StatusNoContent, true},
		{"nothing written at all (gin's 200)", func(*gin.Context) {}, http.StatusOK, true},
		{"c.Status 400 without a body", func(c *gin.Context) { c.Status(http.StatusBadRequest) }, http.StatusBadRequest, false},
		{"c.AbortWithStatus 400", func(c *gin.Context) { c.AbortWithStatus(http.StatusBadRequest) }, http.StatusBadRequest, false},
		{"c.AbortWithStatusJSON 422", func(c *gin.Context) {
			c.AbortWithStatusJSON(http.StatusUnprocessableEntity, gin.H{"error": "bad amount"})
		}, http.StatusUnprocessableEntity, false},
		{"c.String 503", func(c *gin.Context) { c.String(http.StatusServiceUnavailable, "try later") }, http.StatusServiceUnavailable, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, func(w *world, _ *gin.Engine, hooks *gin.RouterGroup) {
				hooks.POST("/hook", func(c *gin.Context) {
					w.write(c)
					tc.answer(c)
				})
			})
			first := w.post("/webhooks/hook", "evt_1")
			assert.Equal(t, tc.want, first.status, "%s", first.body)
			again := w.post("/webhooks/hook", "evt_1")
			assert.Equal(t, tc.want, again.status)
			if tc.final {
				assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
				assert.Equal(t, first.body, again.body)
				assert.Equal(t, 1, w.count(w.ledger), "committed once")
				assert.Equal(t, int64(1), w.runs.Load())
			} else {
				assert.Empty(t, again.header.Get("Idempotent-Replayed"))
				assert.Equal(t, 0, w.count(w.ledger), "rolled back")
				assert.Equal(t, 0, w.count(w.table))
				assert.Equal(t, int64(2), w.runs.Load(), "the redelivery ran again")
			}
		})
	}
}

// TestPanicUnderRecoveryIsRolledBack: gin.Recovery, before Wrap, answers
// 500 on the real writer after idem rolled back; nothing of the buffered
// answer leaks; the redelivery runs.
func TestPanicUnderRecoveryIsRolledBack(t *testing.T) {
	t.Parallel()
	panics := true
	w := newWorld(t, func(w *world, _ *gin.Engine, hooks *gin.RouterGroup) {
		hooks.POST("/hook", func(c *gin.Context) {
			w.write(c)
			if panics {
				c.String(http.StatusCreated, "half an answer")
				panic("boom")
			}
			c.String(http.StatusCreated, "done")
		})
	})
	r := w.post("/webhooks/hook", "evt_1")
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.NotContains(t, string(r.body), "half an answer")
	assert.Equal(t, 0, w.count(w.ledger))
	panics = false
	r = w.post("/webhooks/hook", "evt_1")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, "done", string(r.body))
	assert.Equal(t, 1, w.count(w.ledger))
}

// TestErrorRenderedAfterWrapIsWhatIdemSees: a handler that records
// c.Error and an error-rendering middleware after Wrap: the rendered 502 is
// what idem sees (rolled back) and what the client gets.
func TestErrorRenderedAfterWrapIsWhatIdemSees(t *testing.T) {
	t.Parallel()
	renderErrors := func(c *gin.Context) {
		c.Next()
		if len(c.Errors) > 0 {
			c.JSON(http.StatusBadGateway, gin.H{"error": "downstream failed"})
		}
	}
	w := newWorld(t, func(w *world, _ *gin.Engine, hooks *gin.RouterGroup) {
		hooks.POST("/hook", renderErrors, func(c *gin.Context) {
			w.write(c)
			_ = c.Error(errors.New("payment API down"))
		})
	})
	r := w.post("/webhooks/hook", "evt_1")
	assert.Equal(t, http.StatusBadGateway, r.status)
	assert.JSONEq(t, `{"error":"downstream failed"}`, string(r.body))
	assert.Equal(t, 0, w.count(w.ledger))
	assert.Equal(t, 0, w.count(w.table))
}

// TestIdemsOwnAnswersStopTheChain: a request idem answers by itself (no
// key: 400) never reaches the handler.
func TestIdemsOwnAnswersStopTheChain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, func(w *world, _ *gin.Engine, hooks *gin.RouterGroup) {
		hooks.POST("/hook", func(c *gin.Context) { w.write(c); c.Status(http.StatusCreated) })
	})
	r := w.post("/webhooks/hook", "")
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	assert.Equal(t, int64(0), w.runs.Load())
}

// TestStormThroughGin: concurrent deliveries of many events: one ledger
// row per event, and every answer to an event the same bytes.
func TestStormThroughGin(t *testing.T) {
	t.Parallel()
	w := newWorld(t, func(w *world, _ *gin.Engine, hooks *gin.RouterGroup) {
		hooks.POST("/hook", func(c *gin.Context) {
			w.write(c)
			var id int64
			tx, _ := idem.Tx(c.Request.Context())
			require.NoError(t, tx.QueryRowContext(c.Request.Context(), `SELECT count(*) FROM `+w.ledger).Scan(&id))
			c.JSON(http.StatusCreated, gin.H{"seen": id})
		})
	})
	const events, copies = 20, 4
	var mu sync.Mutex
	bodies := map[string][][]byte{}
	var wg sync.WaitGroup
	for i := 0; i < events; i++ {
		for j := 0; j < copies; j++ {
			wg.Add(1)
			go func(id string) {
				defer wg.Done()
				for try := 0; try < 20; try++ {
					req, _ := http.NewRequest(http.MethodPost, w.srv.URL+"/webhooks/hook", bytes.NewBufferString(`{"n":1}`))
					req.Header.Set("X-Event-Id", id)
					res, err := http.DefaultClient.Do(req)
					if !assert.NoError(t, err) {
						return
					}
					b, _ := io.ReadAll(res.Body)
					res.Body.Close()
					if res.StatusCode == http.StatusConflict || res.StatusCode == http.StatusServiceUnavailable {
						continue // in flight or busy: the sender retries
					}
					assert.Equal(t, http.StatusCreated, res.StatusCode, "%s", b)
					mu.Lock()
					bodies[id] = append(bodies[id], b)
					mu.Unlock()
					return
				}
				t.Errorf("%s never answered 201", id)
			}(fmt.Sprintf("evt_%d", i))
		}
	}
	wg.Wait()
	assert.Equal(t, events, w.count(w.ledger), "one side effect per event")
	for id, bs := range bodies {
		assert.Len(t, bs, copies, id)
		for _, b := range bs {
			assert.Equal(t, bs[0], b, id)
		}
	}
}

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// TestErrorRenderedBeforeWrapComesTooLate: an error renderer before Wrap
// writes after idem has answered; the client gets what idem committed (the
// handler's own 200), never a status that disagrees with the stored one.
func TestErrorRenderedBeforeWrapComesTooLate(t *testing.T) {
	t.Parallel()
	w := newWorldWith(t, func(w *world, wrap gin.HandlerFunc) *gin.Engine {
		r := gin.New()
		r.Use(gin.Recovery(), func(c *gin.Context) {
			c.Next()
			if len(c.Errors) > 0 {
				c.JSON(http.StatusBadGateway, gin.H{"error": "too late"})
			}
		}, wrap)
		r.POST("/hook", func(c *gin.Context) {
			w.write(c)
			_ = c.Error(errors.New("recorded, not rendered"))
			c.String(http.StatusOK, "stored")
		})
		return r
	})
	first := w.post("/hook", "evt_1")
	assert.Equal(t, http.StatusOK, first.status)
	assert.Equal(t, "stored", string(first.body))
	again := w.post("/hook", "evt_1")
	assert.Equal(t, http.StatusOK, again.status)
	assert.Equal(t, "stored", string(again.body))
	assert.Equal(t, 1, w.count(w.ledger))
}

// TestWrapServesIdempgx: Wrap takes idempgx's middleware as well; the
// handler writes through the pgx.Tx.
func TestWrapServesIdempgx(t *testing.T) {
	t.Parallel()
	n := seq.Add(1)
	table, ledger := fmt.Sprintf("keys_%d", n), fmt.Sprintf("ledger_%d", n)
	pool, err := pgxpool.New(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, idempgx.Migrate(t.Context(), pool, table))
	_, err = pool.Exec(t.Context(), `CREATE TABLE `+ledger+` (id bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: table, Logger: discard()})
	require.NoError(t, err)
	r := gin.New()
	r.Use(gin.Recovery(), idemgin.Wrap(mw.Handler))
	r.POST("/hook", func(c *gin.Context) {
		tx, ok := idempgx.Tx(c.Request.Context())
		require.True(t, ok)
		var id int64
		require.NoError(t, tx.QueryRow(c.Request.Context(), `INSERT INTO `+ledger+` (event_id) VALUES ('x') RETURNING id`).Scan(&id))
		c.JSON(http.StatusCreated, gin.H{"id": id})
	})
	w := &world{t: t, table: table, ledger: ledger, srv: httptest.NewServer(r)}
	t.Cleanup(w.srv.Close)
	first, again := w.post("/hook", "evt_1"), w.post("/hook", "evt_1")
	assert.Equal(t, http.StatusCreated, first.status)
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, 1, w.count(ledger))
}
