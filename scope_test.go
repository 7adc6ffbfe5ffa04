package idem_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// postTo sends a JSON body to path on f's server with the given method.
func (f *fixture) postTo(method, path, body string) reply {
	f.t.Helper()
	req, err := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	require.NoError(f.t, err)
	req.Header.Set("Content-Type", "application/json")
	return f.send(req)
}

// Stripe sends one event to every endpoint subscribed to it: two endpoints
// of one app, behind one middleware with the Stripe preset, must each run
// the event once and replay their own answer.
func TestPresetsScopeKeysByEndpoint(t *testing.T) {
	mux := http.NewServeMux()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, mux)
	mux.Handle("POST /webhooks/stripe", f.ledgerHandler())
	mux.Handle("POST /webhooks/stripe-billing", f.ledgerHandler())
	event := `{"id":"evt_1","type":"invoice.paid"}`

	first := f.postTo(http.MethodPost, "/webhooks/stripe", event)
	second := f.postTo(http.MethodPost, "/webhooks/stripe-billing", event)
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	require.Equal(t, http.StatusCreated, second.status, "%s", second.body)
	assert.NotEqual(t, first.body, second.body, "each endpoint ran the event itself")
	assert.Equal(t, 2, f.ledgerRows())

	for path, want := range map[string]reply{"/webhooks/stripe": first, "/webhooks/stripe-billing": second} {
		again := f.postTo(http.MethodPost, path, event)
		assert.Equal(t, want.body, again.body, "%s replays its own answer", path)
		assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	}
	assert.Equal(t, 2, f.ledgerRows())
	var sources []string
	rows, err := f.db.Query(`SELECT source FROM "` + f.table + `" ORDER BY source`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		sources = append(sources, s)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"stripe POST /webhooks/stripe", "stripe POST /webhooks/stripe-billing"}, sources)

	// A method the route does not serve is the router's answer (405), not
	// the replay of the POST's; nothing is stored for it.
	put := f.postTo(http.MethodPut, "/webhooks/stripe", event)
	assert.Equal(t, http.StatusMethodNotAllowed, put.status, "%s", put.body)
	assert.Empty(t, put.header.Get("Idempotent-Replayed"))
	assert.Equal(t, 2, f.keys())
}

// WithSource shares one scope between endpoints, when that is what the
// application wants: the second endpoint replays the first one's answer.
func TestWithSourceSharesAScope(t *testing.T) {
	mux := http.NewServeMux()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe().WithSource("stripe")}, mux)
	mux.Handle("POST /a", f.ledgerHandler())
	mux.Handle("POST /b", f.ledgerHandler())
	first := f.postTo(http.MethodPost, "/a", `{"id":"evt_2"}`)
	second := f.postTo(http.MethodPost, "/b", `{"id":"evt_2"}`)
	require.Equal(t, http.StatusCreated, first.status)
	assert.Equal(t, first.body, second.body)
	assert.Equal(t, "true", second.header.Get("Idempotent-Replayed"))
	assert.Equal(t, 1, f.ledgerRows())
}

// Bodies a JSON preset cannot read are answered 400 with a problem that
// names the body, not the key, and leave nothing behind.
func TestBadBodiesAreNamedAsSuch(t *testing.T) {
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, nil)
	for name, req := range map[string]func() reply{
		"missing": func() reply { return f.postTo(http.MethodPost, "/hook", "") },
		"form-encoded": func() reply {
			req, err := http.NewRequest(http.MethodPost, f.srv.URL+"/hook", strings.NewReader("id=evt_1&type=x"))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			return f.send(req)
		},
	} {
		r := req()
		assert.Equal(t, http.StatusBadRequest, r.status, name)
		doc := problemDoc(t, r)
		assert.True(t, strings.HasSuffix(doc["type"].(string), "#invalid-body"), "%s: %v", name, doc["type"])
		assert.Equal(t, "Missing or malformed request body", doc["title"], name)
	}
	long := f.postTo(http.MethodPost, "/hook/"+strings.Repeat("p", 300), `{"id":"evt_3"}`)
	assert.Equal(t, http.StatusBadRequest, long.status)
	assert.Contains(t, string(long.body), "WithSource")
	assert.Equal(t, 0, f.keys())
	assert.Equal(t, 0, f.ledgerRows())
}

// Every spelling of a path that a router routes to one handler is one
// endpoint (issue 28, F1): escapes are decoded (gorilla/mux routes
// /webhooks%2Fstripe to /webhooks/stripe, so an escaped slash too), and
// the path is spelled as sent where every byte may stand unescaped, else
// with net/url's escapes (upper-case hex digits); a trailing slash stays.
// /hooks/a%21b and /hooks/a!b are one endpoint: ServeMux routes them alike.
func TestEndpointSourcesNormaliseThePath(t *testing.T) {
	for path, want := range map[string]string{
		"/webhooks/%73tripe":               "/webhooks/stripe",
		"/%77ebhooks/stripe":               "/webhooks/stripe",
		"/webhooks/s%74ripe":               "/webhooks/stripe",
		"/%77%65%62%68%6F%6f%6B%73/STRIPE": "/webhooks/STRIPE",
		"/webhooks/%2E/stripe":             "/webhooks/./stripe",
		"/webhooks/a%2fb":                  "/webhooks/a/b",
		"/webhooks/a%2Fb":                  "/webhooks/a/b",
		"/webhooks/stripe%2f":              "/webhooks/stripe/",
		"/hooks/a%21b":                     "/hooks/a!b",
		"/hooks/a!b":                       "/hooks/a!b",
		"/hooks/%28x%29%5Bx%5D%2A%27":      "/hooks/(x)[x]*'",
		"/a%21b%5Bc%5d%3a":                 "/a!b[c]:",
		"/a%25b":                           "/a%25b",
		"/a%252F":                          "/a%252F",
		"/caf%c3%a9%21":                    "/caf%C3%A9%21",
		"/a%22b!c":                         "/a%22b%21c",
		"/a%22b%2fc!":                      "/a%22b/c%21",
	} {
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{"id":"evt_1"}`))
		k, err := idem.Stripe()(r, []byte(`{"id":"evt_1"}`))
		require.NoError(t, err, path)
		assert.Equal(t, "stripe POST "+want, k.Source, path)
	}
}

// One captured delivery, sent under every spelling of its path, runs the
// handler once on http.ServeMux (which routes on the decoded path); a
// pattern's wildcard still tells two accounts' endpoints apart.
func TestPercentSpellingsOfAPathAreOneEndpointOnServeMux(t *testing.T) {
	t.Parallel()
	mux := http.NewServeMux()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, mux)
	mux.Handle("POST /webhooks/stripe", f.ledgerHandler())
	mux.Handle("POST /accounts/{account}/stripe", f.ledgerHandler())
	const event = `{"id":"evt_spelled","type":"payment_intent.succeeded"}`

	first := f.postTo(http.MethodPost, "/webhooks/stripe", event)
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	for _, p := range []string{"/webhooks/%73tripe", "/%77ebhooks/stripe", "/webhooks/s%74ripe", "/%77ebhooks/%73%74%72%69%70%65"} {
		again := f.postTo(http.MethodPost, p, event)
		assert.Equal(t, first.body, again.body, "%s replays", p)
		assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"), p)
	}
	assert.Equal(t, 1, f.ledgerRows(), "one payment, however the path is spelled")

	one := f.postTo(http.MethodPost, "/accounts/acct_1/stripe", event)
	two := f.postTo(http.MethodPost, "/accounts/acct_2/stripe", event)
	require.Equal(t, http.StatusCreated, one.status, "%s", one.body)
	require.Equal(t, http.StatusCreated, two.status, "%s", two.body)
	assert.NotEqual(t, one.body, two.body, "each account's endpoint runs the event")
	again := f.postTo(http.MethodPost, "/accounts/acct_%31/stripe", event)
	assert.Equal(t, one.body, again.body)
	assert.Equal(t, 3, f.ledgerRows())
	assert.Equal(t, 3, f.keys())
}
