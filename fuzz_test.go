package idem

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// Fuzz targets for every parser of untrusted input and for the recorder.
// `go test` runs their seeds; scripts/fuzz.sh fuzzes each for a bounded
// time.

// checkKeyErr asserts that a KeyFunc's error is one the middleware shows to
// the caller as a 400, and that its detail does not echo the input back.
func checkKeyErr(t *testing.T, err error, inputs ...string) {
	t.Helper()
	if !errors.Is(err, ErrNoKey) && !errors.Is(err, ErrInvalidKey) && !errors.Is(err, ErrBadBody) {
		t.Fatalf("error %q wraps none of ErrNoKey, ErrInvalidKey, ErrBadBody", err)
	}
	p := keyProblem(err)
	if p.Status != http.StatusBadRequest {
		t.Fatalf("error %q is answered %d, want 400", err, p.Status)
	}
	for _, in := range inputs {
		// Inputs made only of what the fixed messages are made of could
		// match them by chance; any other long input must not be echoed.
		if len(in) >= 16 && strings.Trim(in, messageChars) != "" && strings.Contains(p.Detail, in) {
			t.Fatalf("the problem detail %q echoes the untrusted input", p.Detail)
		}
	}
}

const messageChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 :()-."

// checkAccepted asserts that a key the middleware accepts can be stored: it
// passes the validation rules, and those rules mean what they say.
func checkAccepted(t *testing.T, k Key) {
	t.Helper()
	if err := validateKey(k); err != nil {
		checkKeyErr(t, err)
		return
	}
	for _, part := range []string{k.Source, k.EventID} {
		if part == "" || len(part) > MaxKeyLen || !utf8.ValidString(part) {
			t.Fatalf("validateKey accepted %q", part)
		}
		for _, c := range part {
			if c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) {
				t.Fatalf("validateKey accepted %q with control character %U", part, c)
			}
		}
	}
}

func FuzzJSONField(f *testing.F) {
	for _, s := range []struct{ body, path string }{
		{`{"id": "evt_1"}`, "id"},
		{`{"id": 12345678901234567890}`, "id"},
		{`{"id": -1.5e300}`, "id"},
		{`{"data": {"id": "evt_1"}, "id": "outer"}`, "data.id"},
		{`{"data": {"id": "a", "id": "b"}}`, "data.id"},
		{`{"data": {"x": 1}, "data": {"id": "a"}}`, "data.id"},
		{`{"id": "evt\u0000"}`, "id"},
		{`{"id": "\ud800"}`, "id"},
		{"{\"id\": \"\xff\"}", "id"},
		{`{"a": [[[[{"id": 1}]]]], "id": "x"}`, "id"},
		{`{"id": {"nested": "x"}}`, "id"},
		{`{"id": null}`, "id"},
		{`["id"]`, "id"},
		{`{"id": "x"} {"id": "y"}`, "id"},
		{`{"id": "evt_A", "ID": "evt_B"}`, "id"},
		{`{"kid": "a", "\u212aid": "b"}`, "kid"},
		{`{"d\u0061ta": {"id": "x"}}`, "data.id"},
		{strings.Repeat("[", 20000) + strings.Repeat("]", 20000), "id"},
		{`{"id": "` + strings.Repeat("a", 300) + `"}`, "id"},
		{``, "id"},
	} {
		f.Add([]byte(s.body), s.path)
	}
	f.Fuzz(func(t *testing.T, body []byte, path string) {
		segs := strings.Split(path, ".")
		for _, s := range segs {
			if s == "" {
				return // JSONField panics on such a path when it is built
			}
		}
		k, err := JSONField("src", path)(httptest.NewRequest(http.MethodPost, "/", nil), body)
		if err != nil {
			checkKeyErr(t, err)
			return
		}
		if k.Source != "src" {
			t.Fatalf("source %q", k.Source)
		}
		// Oracle: encoding/json finds the same value at the path. (JSONField
		// refused duplicates on the path, so the map's last-wins is moot.)
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		var doc any
		if err := dec.Decode(&doc); err != nil {
			t.Fatalf("JSONField accepted a body encoding/json refuses: %v", err)
		}
		v := doc
		for _, s := range segs {
			obj, ok := v.(map[string]any)
			if !ok {
				t.Fatalf("JSONField found %q where encoding/json has no object", k.EventID)
			}
			v, ok = obj[s]
			if !ok {
				t.Fatalf("JSONField found %q at a path encoding/json lacks", k.EventID)
			}
		}
		sameID(t, k.EventID, v, "a map decoded by encoding/json")
		checkAccepted(t, k)
		// Oracle: a handler decoding the body into a struct with the field
		// reads the same id (encoding/json matches names in any case).
		if len(segs) == 1 && validTagName(segs[0]) {
			v := reflect.New(reflect.StructOf([]reflect.StructField{{
				Name: "V", Type: reflect.TypeFor[any](), Tag: reflect.StructTag(`json:"` + segs[0] + `"`),
			}}))
			dec := json.NewDecoder(bytes.NewReader(body))
			dec.UseNumber()
			if err := dec.Decode(v.Interface()); err != nil {
				t.Fatalf("JSONField accepted a body encoding/json refuses: %v", err)
			}
			sameID(t, k.EventID, v.Elem().Field(0).Interface(), "a struct decoded by encoding/json")
		}
	})
}

// sameID fails t unless the id JSONField found is v's text, as oracle
// decoded it.
func sameID(t *testing.T, id string, v any, oracle string) {
	t.Helper()
	switch want := v.(type) {
	case string:
		if want == id {
			return
		}
	case json.Number:
		if want.String() == id {
			return
		}
	}
	t.Fatalf("JSONField found %q, %s %#v", id, oracle, v)
}

// validTagName reports whether encoding/json takes s from a struct tag as a
// field's name.
func validTagName(s string) bool {
	for _, c := range s {
		switch {
		case strings.ContainsRune("!#$%&()*+-./:;<=>?@[]^_{|}~ ", c):
		case !unicode.IsLetter(c) && !unicode.IsDigit(c):
			return false
		}
	}
	return s != "" && s != "-" // "-": the field is skipped
}

// sfQuote serializes s as an RFC 8941 sf-string.
func sfQuote(s string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

func FuzzParseIdempotencyKey(f *testing.F) {
	for _, s := range []string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`,
		`8e03978e-40d5-43e8-bc93-6894a57f9324`,
		`"a\"b\\c"`, `"a\nb"`, `"a\b"`, `"abc";p=1`, `"abc" ; p`, `"abc",`, `"abc" x`,
		`"unterminated`, `""`, ``, ` `, "\t\"x\"\t", `a b`, `a;b`, `a,b`, `a\b`,
		"\"caf\xc3\xa9\"", "\"nul\x00\"", `"` + strings.Repeat("k", 10000) + `"`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		id, err := ParseIdempotencyKey(v)
		if err != nil {
			checkKeyErr(t, err, v)
		} else {
			for i := 0; i < len(id); i++ {
				if id[i] < 0x20 || id[i] > 0x7e {
					t.Fatalf("ParseIdempotencyKey(%q) = %q: not printable ASCII", v, id)
				}
			}
			// Round trip: the parsed key, serialized again, parses to itself,
			// with or without parameters.
			for _, again := range []string{sfQuote(id), sfQuote(id) + ";x=1", " " + sfQuote(id) + " "} {
				if back, err := ParseIdempotencyKey(again); err != nil || back != id {
					t.Fatalf("ParseIdempotencyKey(%q) = %q, %v; want %q", again, back, err, id)
				}
			}
			// Through the KeyFunc, the key is what the middleware validates.
			r := httptest.NewRequest(http.MethodPost, "/", nil)
			r.Header["Idempotency-Key"] = []string{v}
			k, err := IdempotencyKey("api")(r, nil)
			if err != nil || k.EventID != id || k.Source != "api" {
				t.Fatalf("IdempotencyKey KeyFunc = %+v, %v; ParseIdempotencyKey = %q", k, err, id)
			}
			checkAccepted(t, k)
		}
		// Any printable-ASCII string, quoted, comes back unchanged.
		var printable strings.Builder
		for i := 0; i < len(v); i++ {
			if v[i] >= 0x20 && v[i] <= 0x7e {
				printable.WriteByte(v[i])
			}
		}
		want := printable.String()
		if back, err := ParseIdempotencyKey(sfQuote(want)); err != nil || back != want {
			t.Fatalf("ParseIdempotencyKey(%q) = %q, %v; want %q", sfQuote(want), back, err, want)
		}
	})
}

// headerKeyFuncs are the presets that read headers, with the header that
// carries the event id and the source they scope it by ("" for GitHub,
// whose source depends on a second header).
var headerKeyFuncs = []struct {
	name, header, source string
	kf                   KeyFunc
}{
	{"Header", "X-Event-Id", "test", Header("test", "x-event-id")},
	{"Shopify", "X-Shopify-Event-Id", "shopify POST /", Shopify()},
	{"GitHub", "X-Github-Delivery", "", GitHub()},
	{"StandardWebhooks", "Webhook-Id", "sw POST /", StandardWebhooks("sw")},
	{"StandardWebhooks via svix-id", "Svix-Id", "sw POST /", StandardWebhooks("sw")},
}

func FuzzHeaderKeyFuncs(f *testing.F) {
	for _, s := range []struct {
		v, second, hook string
		twice           bool
	}{
		{"evt_1", "", "", false},
		{"72d3162e-cc78-11e3-81ab-4c9367dc0958", "", "12345", false},
		{"evt_1", "evt_2", "", true},
		{"", "", "", false},
		{"evt\x00", "", "", false},
		{"evt\x1b[31m", "", "hook\x7f", false},
		{"\xff\xfe", "", "", false},
		{"caf\xc3\xa9", "", "", false},
		{"\u0085", "", "", false},
		{strings.Repeat("k", 10000), "", "", false},
		{"evt_1", "", strings.Repeat("h", 300), false},
	} {
		f.Add(s.v, s.second, s.hook, s.twice)
	}
	f.Fuzz(func(t *testing.T, v, second, hook string, twice bool) {
		for _, kf := range headerKeyFuncs {
			r := httptest.NewRequest(http.MethodPost, "/", nil)
			r.Header[kf.header] = []string{v}
			if twice {
				r.Header[kf.header] = append(r.Header[kf.header], second)
			}
			if hook != "" {
				r.Header["X-Github-Hook-Id"] = []string{hook}
			}
			k, err := kf.kf(r, nil)
			switch {
			case err != nil:
				checkKeyErr(t, err, v, second, hook)
				continue
			case twice:
				t.Fatalf("%s accepted a key header sent twice: %+v", kf.name, k)
			case v == "":
				t.Fatalf("%s accepted an empty key header: %+v", kf.name, k)
			case k.EventID != v:
				t.Fatalf("%s: event id %q, header %q", kf.name, k.EventID, v)
			}
			wantSource := kf.source
			if wantSource == "" {
				wantSource = "github POST /"
				if hook != "" {
					wantSource = "github:" + hook + " POST /"
				}
			}
			if k.Source != wantSource {
				t.Fatalf("%s: source %q, want %q", kf.name, k.Source, wantSource)
			}
			checkAccepted(t, k)
		}
	})
}

// strictWriter is the connection's ResponseWriter under a recorder: the
// recorder must never touch it.
type strictWriter struct {
	t      *testing.T
	header http.Header
}

func (s *strictWriter) Header() http.Header { return s.header }
func (s *strictWriter) Write([]byte) (int, error) {
	s.t.Fatal("the recorder wrote to the connection")
	return 0, nil
}
func (s *strictWriter) WriteHeader(int) { s.t.Fatal("the recorder sent a status") }
func (s *strictWriter) Flush()          { s.t.Fatal("the recorder flushed the connection") }

// FuzzRecorder drives the recorder with random sequences of handler calls
// and checks it against a model of net/http's rules: the first final status
// wins, 1xx are dropped, Write before WriteHeader means 200, the body is the
// concatenation of the writes that succeeded, never over the limit; after an
// overflow every write fails; nothing reaches the real writer; a recorder
// released to the pool comes back clean.
func FuzzRecorder(f *testing.F) {
	f.Add([]byte{0, 201, 0, 1, 5, 2, 3, 0, 99, 1, 3}, uint16(16))
	f.Add([]byte{1, 200, 1, 10, 1, 1}, uint16(8))
	f.Add([]byte{0, 100, 0, 0, 103, 0, 2, 4, 0, 44, 1}, uint16(0))
	f.Add([]byte{4, 1, 5, 6, 4, 2}, uint16(100))
	f.Add([]byte{0, 255, 255}, uint16(10))
	f.Fuzz(func(t *testing.T, ops []byte, limit uint16) {
		under := &strictWriter{t: t, header: http.Header{"X-Outer": {"1"}}}
		rec := newRecorder(under, int(limit))
		var (
			status   int // the model's final status, 0 until written
			body     []byte
			overflow bool
		)
		next := func() byte {
			if len(ops) == 0 {
				return 0
			}
			b := ops[0]
			ops = ops[1:]
			return b
		}
		for len(ops) > 0 {
			switch next() % 6 {
			case 0: // WriteHeader: codes from 0 to 1023, valid or not
				code := int(next())<<2 | int(next()&3)
				func() {
					defer func() {
						p := recover()
						invalid := code < 100 || code > 999
						switch {
						case p != nil && (!invalid || status != 0):
							t.Fatalf("WriteHeader(%d) panicked: %v", code, p)
						case p == nil && invalid && status == 0:
							t.Fatalf("WriteHeader(%d) did not panic, as net/http does", code)
						}
					}()
					rec.WriteHeader(code)
				}()
				if status == 0 && code >= 200 && code <= 999 {
					status = code
				}
			case 1, 2: // Write or WriteString of n bytes
				n := int(next())
				p := bytes.Repeat([]byte{byte('a' + len(body)%26)}, n)
				var got int
				var err error
				if len(ops)%2 == 0 {
					got, err = rec.Write(p)
				} else {
					got, err = rec.WriteString(string(p))
				}
				if status == 0 {
					status = http.StatusOK
				}
				if overflow || len(body)+n > int(limit) {
					overflow = true
					if got != 0 || !errors.Is(err, ErrResponseTooLarge) {
						t.Fatalf("write over the limit: %d, %v", got, err)
					}
					continue
				}
				if got != n || err != nil {
					t.Fatalf("write of %d: %d, %v", n, got, err)
				}
				body = append(body, p...)
			case 3: // Flush, directly and through ResponseController
				rec.Flush()
				if err := http.NewResponseController(rec).Flush(); err != nil {
					t.Fatalf("ResponseController.Flush: %v", err)
				}
			case 4: // the handler's headers
				rec.Header().Add("X-Handler", string(rune('a'+next()%26)))
			case 5: // Hijack is refused
				if _, _, err := http.NewResponseController(rec).Hijack(); !errors.Is(err, ErrHijack) {
					t.Fatalf("Hijack: %v", err)
				}
			}
		}
		want := status
		if want == 0 {
			want = http.StatusOK
		}
		if got := rec.finalStatus(); got != want {
			t.Fatalf("final status %d, want %d", got, want)
		}
		if !bytes.Equal(rec.body.Bytes(), body) {
			t.Fatalf("body %q, want %q", rec.body.Bytes(), body)
		}
		if rec.body.Len() > int(limit) || rec.overflow != overflow {
			t.Fatalf("body %d bytes, limit %d, overflow %v (want %v)", rec.body.Len(), limit, rec.overflow, overflow)
		}
		if len(under.header) != 1 || under.header.Get("X-Outer") != "1" || rec.Header().Get("X-Outer") != "1" {
			t.Fatalf("headers leaked between the recorder %v and the connection %v", rec.Header(), under.header)
		}
		// Recorders are pooled: the next one starts clean, whatever this
		// one went through.
		rec.release()
		next2 := newRecorder(&strictWriter{t: t, header: http.Header{}}, 5)
		defer next2.release()
		if next2.wroteHeader || next2.status != 0 || next2.body.Len() != 0 || next2.overflow || len(next2.Header()) != 0 || next2.limit != 5 {
			t.Fatalf("a recorder from the pool is not clean: status %d, body %q, overflow %v, header %v",
				next2.status, next2.body.Bytes(), next2.overflow, next2.Header())
		}
	})
}

// FuzzEndpointPath: the presets' path is plain printable ASCII, a fixed
// point (its own spelling), and names the same segments as the path sent:
// decoding each piece between escaped slashes gives the same text.
func FuzzEndpointPath(f *testing.F) {
	for _, s := range []string{"/webhooks/stripe", "/webhooks/%73tripe", "/a%2fb/", "/caf%c3%a9!", "/a%22b%2Fc!", "/a%25%32F", "/%zz", "/a b", "/%2F%2f%2F", "/a[b]%5d"} {
		f.Add(s)
	}
	// respell escapes every byte of the path but slashes, and every other
	// slash too: a spelling that ServeMux and gorilla/mux route as the
	// path itself.
	respell := func(path string) string {
		var b strings.Builder
		for i := 0; i < len(path); i++ {
			if path[i] == '/' && i%2 == 0 {
				b.WriteByte('/')
				continue
			}
			fmt.Fprintf(&b, "%%%02X", path[i])
		}
		return b.String()
	}
	f.Fuzz(func(t *testing.T, target string) {
		u, err := url.ParseRequestURI(target)
		if err != nil || u.Opaque != "" || !strings.HasPrefix(target, "/") {
			return
		}
		p := endpointPath(u)
		for i := 0; i < len(p); i++ {
			if p[i] <= ' ' || p[i] >= 0x7f {
				t.Fatalf("%q: path %q is not printable ASCII", target, p)
			}
		}
		again, err := url.ParseRequestURI(p)
		if err != nil {
			t.Fatalf("%q: path %q does not parse: %v", target, p, err)
		}
		if again.Path != u.Path {
			t.Fatalf("%q: path %q names %q, not %q", target, p, again.Path, u.Path)
		}
		if q := endpointPath(again); q != p {
			t.Fatalf("%q: path %q is spelled %q when sent", target, p, q)
		}
		other, err := url.ParseRequestURI(respell(u.Path))
		if err != nil {
			t.Fatalf("%q: the respelling %q does not parse: %v", target, respell(u.Path), err)
		}
		if q := endpointPath(other); q != p {
			t.Fatalf("%q: the same path spelled %q is the endpoint %q, not %q", target, respell(u.Path), q, p)
		}
	})
}
