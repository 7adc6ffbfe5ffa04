package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What one sender, or anyone who can reach the endpoint, must not be able to
// do: inject SQL through configuration, read another sender's answers, get
// credentials replayed, or learn internals from logs and error answers.

// quoted quotes a PostgreSQL identifier, for the tests' own SQL.
func quoted(ident string) string { return `"` + strings.ReplaceAll(ident, `"`, `""`) + `"` }

// Table names are lower-case identifiers, optionally schema-qualified:
// names PostgreSQL reads the same quoted or not. They work end to end
// (migrate, claim, replay, sweep), keywords included, since idem quotes
// them all the same; every other name, hostile or merely odd, is refused
// with an "idem: " error before any SQL runs: on a closed *sql.DB, whose
// every statement fails with another error, and with the victim table of
// an injection left standing.
func TestTableNamesAreValidatedNeverInjected(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, idem.Options{}, nil)
	victim := "victim_" + f.table
	_, err := f.db.Exec(`CREATE TABLE ` + victim + ` (v int); INSERT INTO ` + victim + ` VALUES (1)`)
	require.NoError(t, err)
	schema := "s_" + f.table
	_, err = f.db.Exec(`CREATE SCHEMA ` + schema)
	require.NoError(t, err)

	t.Run("lower-case identifiers work end to end", func(t *testing.T) {
		for _, name := range []string{
			"t_" + f.table,
			"_" + f.table + "_2",
			schema + ".keys",
			schema + ".order", // a keyword: quoted in every statement
			"m" + strings.Repeat("x", 62),
			schema + "." + strings.Repeat("y", 63),
		} {
			require.NoError(t, idem.Migrate(ctx, f.db, name), name)
			mw, err := newMW(t, f.db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: name})
			require.NoError(t, err, name)
			h := mw.Handler(f.ledgerHandler())
			var bodies []string
			for i := 0; i < 2; i++ {
				rec := httptest.NewRecorder()
				req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
				req.Header.Set("X-Event-Id", "evt_1")
				h.ServeHTTP(rec, req)
				require.Equal(t, http.StatusCreated, rec.Code, "%s: %s", name, rec.Body)
				bodies = append(bodies, rec.Body.String())
			}
			assert.Equal(t, bodies[0], bodies[1], "%s: claimed, completed and replayed", name)
			var n int
			require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM `+quotedName(name)).Scan(&n))
			assert.Equal(t, 1, n, name)
			_, err = idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: name, Retention: time.Hour, UnsafeShortRetention: true, Pause: -1})
			require.NoError(t, err, name)
		}
	})

	closed := idem.OpenTestDB(t)
	dsn, _ := idem.DSNOf(closed)
	closed, err = sql.Open("pgx", dsn)
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	refused := map[string][]string{
		"a double quote":       {`a"b`, f.table + `"; DROP TABLE ` + victim + `; --`, `"` + f.table + `"`},
		"a single quote":       {`a'b`, f.table + `'); DROP TABLE ` + victim + `; --`},
		"spaces":               {"a b", " a", "a ", "a\tb", "a\nb"},
		"upper case":           {"Webhooks", "WEBHOOK_IDEMPOTENCY", "public.Keys", "Public.keys"},
		"a leading digit":      {"1keys", "public.2keys", "9.keys"},
		"other punctuation":    {"a-b", "a$b", "a;b", "a/b", `a\b`, "a(b)", "a*", "a,b"},
		"dots in wrong places": {".", "..", ".a", "a.", "a..b", "a.b.c", "public..keys"},
		"too long":             {strings.Repeat("x", 64), "s." + strings.Repeat("y", 64), strings.Repeat("s", 64) + ".keys"},
		"non-ASCII":            {"ïdém", "tаble" /* Cyrillic a */, "keys\u00a0", "ключи", "é.keys"},
		"control bytes":        {"a\x00b", "a\x7fb", "\x00"},
		"invalid UTF-8":        {"a\xffb"},
	}
	for kind, names := range refused {
		t.Run("refused before any SQL: "+kind, func(t *testing.T) {
			for _, name := range names {
				_, err := idem.New(closed, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: name})
				assertRefusedName(t, err, name)
				_, err = newMW(t, f.db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: name})
				assertRefusedName(t, err, name)
				assertRefusedName(t, idem.Migrate(ctx, closed, name), name)
				assertRefusedName(t, idem.MigrateWith(ctx, closed, idem.MigrateOptions{Table: name, PartitionInterval: 24 * time.Hour}), name)
				_, err = idemops.Sweep(ctx, closed, idemops.SweepOptions{Table: name})
				assertRefusedName(t, err, name)
				_, err = idemops.Check(ctx, closed, idemops.CheckOptions{Table: name})
				assertRefusedName(t, err, name)
				_, err = idemops.Stats(ctx, closed, idemops.StatsOptions{Table: name})
				assertRefusedName(t, err, name)
			}
		})
	}
	var n int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM `+victim).Scan(&n), "the victim table survived")
	assert.Equal(t, 1, n)
}

// quotedName quotes each part of a table name, for the tests' own SQL.
func quotedName(name string) string {
	parts := strings.Split(name, ".")
	for i, p := range parts {
		parts[i] = quoted(p)
	}
	return strings.Join(parts, ".")
}

// assertRefusedName checks the error of a refused table name: the
// library's own, naming the table, not one from the database.
func assertRefusedName(t *testing.T, err error, name string) {
	t.Helper()
	if assert.Error(t, err, "%q", name) {
		assert.True(t, strings.HasPrefix(err.Error(), fmt.Sprintf("idem: table %q: ", name)), "%q: %v", name, err)
		assert.NotContains(t, err.Error(), "closed", "%q: no SQL ran", name)
	}
}

// TestKeysAreScopedBySource plays a sender (tenant) that knows or guesses
// another tenant's keys: it never gets their stored answer, and never a 422
// that would tell it the key exists elsewhere.
func TestKeysAreScopedBySource(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{KeyFunc: func(r *http.Request, body []byte) (idem.Key, error) {
		// The source is the tenant an authentication layer vouched for.
		k, err := idem.IdempotencyKey("unset")(r, body)
		k.Source = r.Header.Get("X-Tenant")
		return k, err
	}}, nil)
	post := func(tenant, key, body string) reply {
		return f.post("", body, "X-Tenant", tenant, "Idempotency-Key", `"`+key+`"`)
	}

	victim := post("tenant-a", "order-1", `{"amount": 100}`)
	require.Equal(t, http.StatusCreated, victim.status)

	same := post("tenant-b", "order-1", `{"amount": 100}`)
	assert.Equal(t, http.StatusCreated, same.status)
	assert.Empty(t, same.header.Get("Idempotent-Replayed"), "the same key and body from another tenant runs on its own")
	assert.NotEqual(t, victim.body, same.body)

	other := post("tenant-c", "order-1", `{"amount": 1}`)
	assert.Equal(t, http.StatusCreated, other.status, "not 422: that would reveal tenant-a's key")

	for _, pair := range [][2][2]string{
		{{"a:b", "c"}, {"a", "b:c"}},
		{{"ab", "c"}, {"a", "bc"}},
		{{"a", "b c"}, {"a b", "c"}},
	} {
		for _, k := range pair {
			r := post(k[0], k[1], "{}")
			assert.Equal(t, http.StatusCreated, r.status, "%v", k)
			assert.Empty(t, r.header.Get("Idempotent-Replayed"), "%v: keys that concatenate alike stay apart", k)
		}
	}

	again := post("tenant-a", "order-1", `{"amount": 100}`)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, victim.body, again.body, "tenant-a still gets its own answer")
	assert.Equal(t, 3+6, f.ledgerRows())

	t.Run("GitHub hooks sharing a delivery GUID", func(t *testing.T) {
		g := newFixture(t, idem.Options{KeyFunc: idem.GitHub()}, nil)
		for _, hook := range []string{"", "1", "2"} {
			hdr := []string{"X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"}
			if hook != "" {
				hdr = append(hdr, "X-GitHub-Hook-ID", hook)
			}
			r := g.post("", "{}", hdr...)
			assert.Equal(t, http.StatusCreated, r.status)
			assert.Empty(t, r.header.Get("Idempotent-Replayed"), "hook %q", hook)
		}
		assert.Equal(t, 3, g.ledgerRows())
	})
}

// sensitiveHeaders carry credentials or session state.
var sensitiveHeaders = []string{"Set-Cookie", "Set-Cookie2", "Authorization", "Proxy-Authorization",
	"Www-Authenticate", "Proxy-Authenticate", "Cookie"}

func TestReplayNeverCarriesCookiesOrCredentials(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{ReplayHeaders: []string{"X-Order"}}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, h := range sensitiveHeaders {
			w.Header().Set(h, "secret-"+h)
		}
		w.Header().Set("X-Order", "42")
		w.WriteHeader(http.StatusCreated)
	}))
	first := f.post("evt_1", "{}")
	require.Equal(t, http.StatusCreated, first.status)
	assert.Equal(t, "secret-Set-Cookie", first.header.Get("Set-Cookie"), "the original answer is the handler's own")

	var stored string
	require.NoError(t, f.db.QueryRow(`SELECT response_headers::text FROM "`+f.table+`"`).Scan(&stored))
	assert.NotContains(t, stored, "secret", "never stored")
	dup := f.post("evt_1", "{}")
	assert.Equal(t, "true", dup.header.Get("Idempotent-Replayed"))
	assert.Equal(t, "42", dup.header.Get("X-Order"))
	for _, h := range sensitiveHeaders {
		assert.Empty(t, dup.header.Values(h), "%s is never replayed", h)
	}

	for _, h := range sensitiveHeaders {
		for _, spelling := range []string{h, strings.ToLower(h), strings.ToUpper(h)} {
			_, err := idem.New(f.db, idem.Options{KeyFunc: idem.Header("t", "X-Id"), ReplayHeaders: []string{spelling}})
			assert.Error(t, err, "New refuses %s in ReplayHeaders", spelling)
		}
	}
}

// TestNoOutcomeLogsABody drives every outcome with request and response
// bodies that carry a marker: the logs name keys and causes, never a body.
func TestNoOutcomeLogsABody(t *testing.T) {
	t.Parallel()
	const secret = "SECRET-BODY-7f3a"
	var out logBuffer
	entered, release := make(chan struct{}), make(chan struct{})
	var f *fixture
	f = newFixture(t, idem.Options{
		KeyFunc:        routedKeys(),
		Logger:         slog.New(slog.NewJSONHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})),
		MaxBodyBytes:   1024,
		LockWait:       -1,
		HandlerTimeout: 3 * time.Second, // evt_timeout waits it out; the others must finish within it under load
	}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, _ := idem.KeyFromContext(r.Context())
		switch k.EventID {
		case "evt_inflight":
			close(entered)
			<-release
		case "evt_rollback":
			http.Error(w, "failed: "+secret, http.StatusBadGateway)
			return
		case "evt_timeout":
			<-r.Context().Done()
			return
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	// Storing the answer of evt_store fails.
	_, err := f.db.Exec(`CREATE FUNCTION ` + f.table + `_fail() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN IF NEW.event_id = 'evt_store' THEN RAISE EXCEPTION 'injected store failure'; END IF; RETURN NEW; END $$;
		CREATE TRIGGER fail BEFORE ` + storeEvent() + ` ON "` + f.table + `" FOR EACH ROW EXECUTE FUNCTION ` + f.table + `_fail()`)
	require.NoError(t, err)
	body := `{"card": "` + secret + `"}`

	assert.Equal(t, http.StatusCreated, f.post("evt_ok", body).status)
	assert.Equal(t, "true", f.post("evt_ok", body).header.Get("Idempotent-Replayed"))
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_ok", body+" ").status)
	assert.Equal(t, http.StatusRequestEntityTooLarge, f.post("evt_big", body+strings.Repeat(" ", 1024)).status)
	assert.Equal(t, http.StatusBadRequest, f.post("", body).status)
	for _, b := range []string{`{"data": {"id": "` + secret + "\x01" + `"}}`, `{"data": "` + secret} {
		res, err := http.Post(f.srv.URL+"/json", "application/json", strings.NewReader(b))
		require.NoError(t, err)
		res.Body.Close()
		assert.Equal(t, http.StatusBadRequest, res.StatusCode)
	}
	assert.Equal(t, http.StatusBadGateway, f.post("evt_rollback", body).status)
	assert.Equal(t, http.StatusServiceUnavailable, f.post("evt_timeout", body).status)
	orig := make(chan reply)
	go func() { orig <- f.post("evt_inflight", body) }()
	<-entered
	assert.Equal(t, http.StatusConflict, f.post("evt_inflight", body).status)
	close(release)
	assert.Equal(t, http.StatusCreated, (<-orig).status)
	assert.Equal(t, http.StatusServiceUnavailable, f.post("evt_store", body).status)

	logs := out.String()
	// Failures of the middleware's own are logged with their key (a
	// handler's own non-2xx answer is the handler's to log).
	for _, ev := range []string{"evt_ok", "evt_timeout", "evt_inflight", "evt_store"} {
		assert.Contains(t, logs, `"event_id":"`+ev+`"`)
	}
	assert.NotContains(t, logs, secret)
	assert.NotContains(t, logs, "SECRET")
}

// assertNoInternals checks an error answer of the middleware: a small
// problem+json document with none of the database's or the server's words.
func assertNoInternals(t *testing.T, r reply) {
	t.Helper()
	doc := problemDoc(t, r)
	for k := range doc {
		assert.Contains(t, []string{"type", "title", "status", "detail"}, k)
	}
	for _, word := range []string{"SQLSTATE", "ERROR", "relation", "injected", "trigger", "constraint",
		"transaction is aborted", "terminating", "canceling", "pgx", "pgconn", "sql:", "127.0.0.1", "dial", "idem_", "ledger", "deadline"} {
		assert.NotContains(t, string(r.body), word)
	}
}

// failing returns SQL that makes a trigger fail with errcode and a message
// full of SQL words; when says when it fires ("BEFORE INSERT ON ..."), with
// %[1]s standing for the idempotency table and %[2]s for the ledger.
func failing(when, errcode string) string {
	constraint := ""
	if strings.Contains(when, "DEFERRED") {
		constraint = "CONSTRAINT "
	}
	return `CREATE FUNCTION "%[1]s_fail"() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'injected: relation secret_table, SQLSTATE XX000' USING ERRCODE = '` + errcode + `'; END $$;
		CREATE ` + constraint + `TRIGGER fail ` + when + ` FOR EACH ROW EXECUTE FUNCTION "%[1]s_fail"();`
}

func TestProblemAnswersNeverCarrySQLErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		setup string // SQL run before the request; %[1]s is the idempotency table, %[2]s the ledger
		inner func(f *fixture) http.Handler
		want  int
	}{
		{"the table is missing", `DROP TABLE "%[1]s"`, nil, http.StatusServiceUnavailable},
		{"the claim fails", failing(`BEFORE INSERT ON "%[1]s"`, "P0001"), nil, http.StatusServiceUnavailable},
		{"the claim keeps conflicting", failing(`BEFORE INSERT ON "%[1]s"`, "40001"), nil, http.StatusConflict},
		{"storing the answer fails", failing(`BEFORE `+storeEvent()+` ON "%[1]s"`, "P0001"), nil, http.StatusServiceUnavailable},
		{"COMMIT fails", failing("AFTER INSERT ON %[2]s DEFERRABLE INITIALLY DEFERRED", "P0001"), nil, http.StatusServiceUnavailable},
		{"the handler's statement failed and it answered 201 anyway", "", func(f *fixture) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx, _ := txFrom(r.Context())
				_, err := tx.ExecContext(r.Context(), `SELECT 1/0`)
				assert.Error(t, err)
				w.WriteHeader(http.StatusCreated)
			})
		}, http.StatusInternalServerError},
		{"the handler ended the transaction", "", func(f *fixture) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx, _ := txFrom(r.Context())
				if err := tx.Rollback(); onPgx {
					assert.ErrorIs(t, err, idem.ErrTxMisuse, "idempgx refuses, and sends nothing")
				} else {
					assert.NoError(t, err)
				}
				w.WriteHeader(http.StatusCreated)
			})
		}, http.StatusInternalServerError},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := tc.want
			if strings.HasPrefix(tc.name, "the claim ") && claimInsertsAtStore() {
				want = http.StatusServiceUnavailable // the trigger fails the store, after the handler
			}
			var f *fixture
			f = newFixture(t, claimFirst(idem.Options{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.inner != nil {
					tc.inner(f).ServeHTTP(w, r)
					return
				}
				f.ledgerHandler().ServeHTTP(w, r)
			}))
			if tc.setup != "" {
				_, err := f.db.Exec(fmt.Sprintf(tc.setup, f.table, f.ledger))
				require.NoError(t, err)
			}
			r := f.post("evt_1", "{}")
			assert.Equal(t, want, r.status, "%s", r.body)
			assertNoInternals(t, r)
			assert.Error(t, f.observations()[0].Err, "the cause is kept for logs and metrics")
		})
	}
}
