package idem_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func request(body string, headers ...string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
	for i := 0; i+1 < len(headers); i += 2 {
		r.Header.Add(headers[i], headers[i+1])
	}
	return r
}

func TestKeyFuncs(t *testing.T) {
	cases := []struct {
		name    string
		kf      idem.KeyFunc
		body    string
		headers []string
		want    idem.Key
		err     error
	}{
		{"Header reads the named header", idem.Header("acme", "x-event-id"), "", []string{"X-Event-Id", "e1"}, idem.Key{Source: "acme", EventID: "e1"}, nil},
		{"Header without the header", idem.Header("acme", "X-Event-Id"), "", nil, idem.Key{}, idem.ErrNoKey},
		{"Header sent twice", idem.Header("acme", "X-Event-Id"), "", []string{"X-Event-Id", "a", "X-Event-Id", "b"}, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField top level", idem.JSONField("acme", "id"), `{"id":"evt_1","type":"x"}`, nil, idem.Key{Source: "acme", EventID: "evt_1"}, nil},
		{"JSONField nested", idem.JSONField("acme", "data.id"), `{"data":{"obj":[1,{"id":"no"}],"id":"evt_2"},"id":"top"}`, nil, idem.Key{Source: "acme", EventID: "evt_2"}, nil},
		{"JSONField number keeps its text", idem.JSONField("acme", "event_id"), `{"event_id": 12345678901234567890}`, nil, idem.Key{Source: "acme", EventID: "12345678901234567890"}, nil},
		{"JSONField unescapes strings", idem.JSONField("acme", "id"), `{"id":"a\u00e9\"b"}`, nil, idem.Key{Source: "acme", EventID: "aé\"b"}, nil},
		{"JSONField missing", idem.JSONField("acme", "data.id"), `{"data":{"other":1}}`, nil, idem.Key{}, idem.ErrNoKey},
		{"JSONField parent not an object", idem.JSONField("acme", "data.id"), `{"data":"x"}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField null", idem.JSONField("acme", "id"), `{"id":null}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField boolean", idem.JSONField("acme", "id"), `{"id":true}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe id twice, in two cases", idem.Stripe(), `{"id":"evt_A","ID":"evt_B"}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe id twice, the other case first", idem.Stripe(), `{"Id":"evt_B","id":"evt_A"}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe id only in another case", idem.Stripe(), `{"ID":"evt_B"}`, nil, idem.Key{}, idem.ErrNoKey},
		{"JSONField parent twice, in two cases", idem.JSONField("acme", "data.id"), `{"data":{"id":"a"},"DATA":{"id":"b"}}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField name folded as Unicode folds it", idem.JSONField("acme", "kid"), `{"kid":"a","\u212aid":"b"}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField escaped name", idem.JSONField("acme", "id"), `{"\u0069d":"evt_esc","x":[1,{"id":2}]}`, nil, idem.Key{Source: "acme", EventID: "evt_esc"}, nil},
		{"JSONField duplicate parent", idem.JSONField("acme", "data.id"), `{"data":{"id":"a"},"data":{"id":"b"}}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"JSONField trailing garbage", idem.JSONField("acme", "id"), `{"id":"a"} x`, nil, idem.Key{}, idem.ErrBadBody},
		{"JSONField empty body", idem.JSONField("acme", "id"), "", nil, idem.Key{}, idem.ErrBadBody},
		{"Stripe form-encoded body", idem.Stripe(), "id=evt_1&type=x", []string{"Content-Type", "application/x-www-form-urlencoded"}, idem.Key{}, idem.ErrBadBody},
		{"Stripe numeric id", idem.Stripe(), `{"id":12345}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe huge numeric id", idem.Stripe(), `{"id":1e400}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe negative zero", idem.Stripe(), `{"id":-0}`, nil, idem.Key{}, idem.ErrInvalidKey},
		{"Stripe shared by WithSource", idem.Stripe().WithSource("stripe"), `{"id":"evt_1"}`, nil, idem.Key{Source: "stripe", EventID: "evt_1"}, nil},
		{"JSONField invalid UTF-8 anywhere", idem.JSONField("acme", "id"), "{\"id\":\"a\",\"n\":\"\xc3\"}", nil, idem.Key{}, idem.ErrBadBody},
		{"Stripe", idem.Stripe(), `{"id":"evt_1NG8Du2eZvKYlo2C","object":"event"}`, nil, idem.Key{Source: "stripe POST /", EventID: "evt_1NG8Du2eZvKYlo2C"}, nil},
		{"GitHub scoped by hook", idem.GitHub(), "", []string{"X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958", "X-GitHub-Hook-ID", "292430182"}, idem.Key{Source: "github:292430182 POST /", EventID: "72d3162e-cc78-11e3-81ab-4c9367dc0958"}, nil},
		{"GitHub without hook id", idem.GitHub(), "", []string{"X-GitHub-Delivery", "d1"}, idem.Key{Source: "github POST /", EventID: "d1"}, nil},
		{"GitHub with two hook ids", idem.GitHub(), "", []string{"X-GitHub-Delivery", "d1", "X-GitHub-Hook-ID", "1", "X-GitHub-Hook-ID", "2"}, idem.Key{}, idem.ErrInvalidKey},
		{"GitHub without delivery", idem.GitHub(), "", nil, idem.Key{}, idem.ErrNoKey},
		{"Shopify", idem.Shopify(), "", []string{"X-Shopify-Event-Id", "98880550-7158-44d4-b7cd-2c97c8a091b5"}, idem.Key{Source: "shopify POST /", EventID: "98880550-7158-44d4-b7cd-2c97c8a091b5"}, nil},
		{"Standard Webhooks", idem.StandardWebhooks("resend"), "", []string{"webhook-id", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"}, idem.Key{Source: "resend POST /", EventID: "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"}, nil},
		{"Svix", idem.StandardWebhooks("clerk"), "", []string{"svix-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"}, idem.Key{Source: "clerk POST /", EventID: "msg_p5jXN8AQM9LWM0D4loKWxJek"}, nil},
		{"Standard Webhooks without id", idem.StandardWebhooks("resend"), "", nil, idem.Key{}, idem.ErrNoKey},
		{"Idempotency-Key quoted", idem.IdempotencyKey("api"), "", []string{"Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, idem.Key{Source: "api", EventID: "8e03978e-40d5-43e8-bc93-6894a57f9324"}, nil},
		{"Idempotency-Key bare", idem.IdempotencyKey("api"), "", []string{"Idempotency-Key", "8e03978e-40d5"}, idem.Key{Source: "api", EventID: "8e03978e-40d5"}, nil},
		{"Idempotency-Key missing", idem.IdempotencyKey("api"), "", nil, idem.Key{}, idem.ErrNoKey},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.kf(request(c.body, c.headers...), []byte(c.body))
			if c.err != nil {
				assert.ErrorIs(t, err, c.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.want, got)
		})
	}
}

func TestParseIdempotencyKey(t *testing.T) {
	good := map[string]string{
		`"abc"`:              "abc",
		`"a\"b\\c"`:          `a"b\c`,
		`"with space"`:       "with space",
		`"k";exp=1`:          "k",
		` "padded" `:         "padded",
		`bare-token_1.2:3/4`: "bare-token_1.2:3/4",
		`""`:                 "",
	}
	for in, want := range good {
		got, err := idem.ParseIdempotencyKey(in)
		if assert.NoError(t, err, in) {
			assert.Equal(t, want, got, in)
		}
	}
	for _, in := range []string{`"open`, `"bad\n"`, `"x" y`, `"\x"`, `a b`, `a,b`, `a;b`, `a"b`, "\"\x01\"", "caf\xc3\xa9", ``} {
		_, err := idem.ParseIdempotencyKey(in)
		assert.Error(t, err, in)
	}
}

func TestKeyFuncConstructorsRejectProgrammingErrors(t *testing.T) {
	assert.Panics(t, func() { idem.JSONField("acme", "") })
	assert.Panics(t, func() { idem.JSONField("acme", "data..id") })
	assert.Panics(t, func() { idem.Header("", "X-Id") })
	assert.Panics(t, func() { idem.Header("acme", "") })
	assert.Panics(t, func() { idem.IdempotencyKey("bad\x00source") })
	assert.Panics(t, func() { idem.Stripe().WithSource("") })
}

func TestNewValidatesOptions(t *testing.T) {
	db := idem.OpenTestDB(t)
	kf := idem.Header("acme", "X-Id")
	for name, opts := range map[string]idem.Options{
		"three-part table":       {KeyFunc: kf, Table: "a.b.c"},
		"empty table part":       {KeyFunc: kf, Table: "a."},
		"negative body limit":    {KeyFunc: kf, MaxBodyBytes: -1},
		"negative response cap":  {KeyFunc: kf, MaxResponseBytes: -1},
		"negative timeout":       {KeyFunc: kf, HandlerTimeout: -1},
		"negative retry-after":   {KeyFunc: kf, RetryAfter: -1},
		"Set-Cookie replayed":    {KeyFunc: kf, ReplayHeaders: []string{"set-cookie"}},
		"Authorization replayed": {KeyFunc: kf, ReplayHeaders: []string{"Authorization"}},
		"empty method":           {KeyFunc: kf, Methods: []string{""}},
	} {
		_, err := idem.New(db, opts)
		assert.Error(t, err, name)
	}
	_, err := idem.New(nil, idem.Options{KeyFunc: kf})
	assert.Error(t, err)
	_, err = idem.New(db, idem.Options{KeyFunc: kf, Table: `odd"schema.tbl`})
	assert.ErrorContains(t, err, "a-z, 0-9 and _", "only lower-case identifiers are taken")
	_, err = idem.New(db, idem.Options{KeyFunc: kf, Table: "billing.webhook_keys"})
	assert.NoError(t, err, "a schema-qualified name")
}

// The presets' sources for paths without percent-encoding, as they were
// before presets normalised the path (issue 28): keys already stored under
// them must still be found after an upgrade. Written against the code before
// the change, and unchanged by it.
func TestEndpointSourcesOfPlainPathsStayAsTheyWere(t *testing.T) {
	for path, want := range map[string]string{
		"/":                            "stripe POST /",
		"/webhooks/stripe":             "stripe POST /webhooks/stripe",
		"/webhooks/stripe/":            "stripe POST /webhooks/stripe/",
		"/webhooks/acct_123/stripe":    "stripe POST /webhooks/acct_123/stripe",
		"/a-b_c.d~e/F0":                "stripe POST /a-b_c.d~e/F0",
		"/a!b$c&d'e(f)g*h+i,j;k=l:m@n": "stripe POST /a!b$c&d'e(f)g*h+i,j;k=l:m@n",
		"/a[b]":                        "stripe POST /a[b]",
		"//webhooks//stripe":           "stripe POST //webhooks//stripe",
		"/webhooks/./stripe":           "stripe POST /webhooks/./stripe",
		"/webhooks/stripe?x=1":         "stripe POST /webhooks/stripe",
		"/a\"b!c":                      "stripe POST /a%22b%21c",
		"/a{b}|c^d`e<f>g\\h":           "stripe POST /a%7Bb%7D%7Cc%5Ed%60e%3Cf%3Eg%5Ch",
		"/café!":                       "stripe POST /caf%C3%A9%21",
	} {
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{"id":"evt_1"}`))
		k, err := idem.Stripe()(r, []byte(`{"id":"evt_1"}`))
		require.NoError(t, err, path)
		assert.Equal(t, want, k.Source, path)
	}
}

// hostileBodies are 1 MiB JSON bodies made to cost a key extractor the
// most: very many small values, deep nesting, many members.
func hostileBodies() map[string][]byte {
	const size = 1 << 20
	fill := func(open, unit, close string) []byte {
		n := (size - len(open) - len(close)) / len(unit)
		b := []byte(open + strings.Repeat(unit, n))
		b = b[:len(b)-1] // the last separator
		return append(b, close...)
	}
	deep := strings.Repeat("[", 5000) + strings.Repeat("]", 5000)
	return map[string][]byte{
		"many small values": fill(`{"id":"evt_1","v":[`, "0,", `]}`),
		"many members":      fill(`{"id":"evt_1",`, `"k":1,`, `}`),
		"deep arrays":       fill(`{"id":"evt_1","v":[`, deep+",", `]}`),
		"many strings":      fill(`{"v":[`, `"a\"b",`, `],"id":"evt_1"}`),
	}
}

// The key scan allocates for what it returns, never per value of the body:
// a hostile 1 MiB body costs a handful of allocations (encoding/json's
// token reader made 3 million).
func TestJSONKeyScanAllocationsAreBounded(t *testing.T) {
	kf := idem.Stripe()
	r := httptest.NewRequest(http.MethodPost, "/webhooks/stripe", nil)
	for name, body := range hostileBodies() {
		k, err := kf(r, body)
		require.NoError(t, err, name)
		require.Equal(t, "evt_1", k.EventID, name)
		allocs := testing.AllocsPerRun(3, func() { _, _ = kf(r, body) })
		// A few for the key; the bound leaves room for what other
		// goroutines of the test binary allocate meanwhile (AllocsPerRun
		// counts the whole process's).
		assert.LessOrEqual(t, allocs, 100.0, "%s: allocations per key", name)
	}
}

// BenchmarkJSONKeyScan compares the Stripe preset's key scan with what a
// handler does to read the same id, json.Unmarshal into a struct, on the
// hostile bodies.
func BenchmarkJSONKeyScan(b *testing.B) {
	r := httptest.NewRequest(http.MethodPost, "/webhooks/stripe", nil)
	kf := idem.Stripe()
	for name, body := range hostileBodies() {
		b.Run(name+"/Stripe", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := kf(r, body); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/json.Unmarshal", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				var event struct {
					ID string `json:"id"`
				}
				if err := json.Unmarshal(body, &event); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
