package idem

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"
)

// MaxKeyLen is the longest source or event id, in bytes, that the middleware
// accepts. Longer values are refused with 400 before they reach SQL.
const MaxKeyLen = 255

// Key identifies one logical operation: the same Key on two requests means
// "the same event, delivered again". Source scopes EventID, so two senders
// (providers, tenants, endpoints) can never read each other's stored answers
// or collide on the same id.
type Key struct {
	Source  string // who issued the id: "stripe", "github:1234", a tenant id
	EventID string // the id that stays the same across the sender's retries
}

// KeyFunc extracts the Key of a request. It sees the request and its whole
// body (already read and bounded by Options.MaxBodyBytes); it must not read
// r.Body. An error, or a Key that fails validation (empty, longer than
// MaxKeyLen bytes, invalid UTF-8, NUL or other control characters), is
// answered with 400 and nothing is claimed.
//
// Errors that wrap ErrNoKey, ErrInvalidKey or ErrBadBody are shown to the caller in the
// problem's detail; any other error text is logged, never sent. An error
// that wraps ErrSignature is answered with 401 instead, its text shown too.
type KeyFunc func(r *http.Request, body []byte) (Key, error)

// Header returns a KeyFunc that takes the event id from the request header
// name, scoped by source. A missing header, or one sent more than once, is a
// bad request.
func Header(source, name string) KeyFunc {
	mustSource("Header", source)
	if name == "" {
		panic("idem: Header needs a header name")
	}
	name = http.CanonicalHeaderKey(name)
	return func(r *http.Request, _ []byte) (Key, error) {
		id, err := singleHeader(r, name)
		if err != nil {
			return Key{}, err
		}
		return Key{Source: source, EventID: id}, nil
	}
}

// JSONField returns a KeyFunc that takes the event id from a field of the
// JSON request body, scoped by source. The path is a dot-separated list of
// object keys: "id" is the top-level field, "data.id" reaches into nested
// objects. The field must be a string or a number (a number's id is its
// literal text). Malformed JSON, a missing field, another type, or a key that
// appears twice on the path are bad requests; a name that differs from the
// path's only in case counts as the key appearing again, as encoding/json,
// which a handler likely decodes the body with, matches names in any case
// (`{"id":"evt_A","ID":"evt_B"}` would be evt_B to it). The body is scanned
// once, with no allocation per value.
//
// JSONField panics if path is empty or has an empty segment: that is a
// programming error, caught when the KeyFunc is built.
func JSONField(source, path string) KeyFunc {
	mustSource("JSONField", source)
	segs := strings.Split(path, ".")
	for _, s := range segs {
		if s == "" {
			panic(fmt.Sprintf("idem: JSONField path %q has an empty segment", path))
		}
	}
	return func(r *http.Request, body []byte) (Key, error) {
		id, err := jsonField(r, body, segs, false)
		if err != nil {
			return Key{}, err
		}
		return Key{Source: source, EventID: id}, nil
	}
}

// IdempotencyKey returns a KeyFunc for the IETF Idempotency-Key request
// header (draft-ietf-httpapi-idempotency-key-header): a Structured Field
// string such as `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, or, leniently, the
// same value sent bare. Parameters after a quoted key are ignored. Keys are
// scoped by source: give each client or tenant its own source (with a custom
// KeyFunc that calls this one) so that one client can never hit another's key.
func IdempotencyKey(source string) KeyFunc {
	mustSource("IdempotencyKey", source)
	return func(r *http.Request, _ []byte) (Key, error) {
		raw, err := singleHeader(r, "Idempotency-Key")
		if err != nil {
			return Key{}, err
		}
		id, err := ParseIdempotencyKey(raw)
		if err != nil {
			return Key{}, err
		}
		return Key{Source: source, EventID: id}, nil
	}
}

// Stripe returns the KeyFunc for Stripe webhooks: the event id ("evt_...")
// from the body's top-level "id", which must be a JSON string, scoped by
// the endpoint (source "stripe POST /webhooks/stripe"; see WithSource).
//
// Given the endpoint's signing secrets ("whsec_..."; two while one is being
// rolled), it first verifies the Stripe-Signature header over the exact
// body: a v1 signature made with one of the secrets, with a timestamp
// within 300 seconds of the receiver's clock. A request that fails is
// answered 401 (ErrSignature) before anything is claimed. Without secrets
// it verifies nothing: verify the signature before this middleware runs,
// or a forged delivery can claim a real event's id first. It panics if a
// secret is empty.
func Stripe(secrets ...string) KeyFunc {
	segs := []string{"id"}
	return withSignature(stripeSignature(secrets, time.Now), func(r *http.Request, body []byte) (Key, error) {
		id, err := jsonField(r, body, segs, true)
		if err != nil {
			return Key{}, err
		}
		return endpointKey(r, "stripe", id)
	})
}

// WithSource returns a KeyFunc that takes the event id from f and gives
// every key the fixed source instead of f's. Presets scope their keys by
// endpoint, so that two endpoints that receive the same event (Stripe sends
// one event to every subscribed endpoint) each run it once; WithSource
// makes endpoints share one scope when that is what you want:
//
//	shared := idem.Stripe().WithSource("stripe") // every route: one scope
//
// It panics if source is not a valid source (empty, too long, or with
// control characters).
func (f KeyFunc) WithSource(source string) KeyFunc {
	mustSource("WithSource", source)
	return func(r *http.Request, body []byte) (Key, error) {
		k, err := f(r, body)
		if err != nil {
			return Key{}, err
		}
		k.Source = source
		return k, nil
	}
}

// endpointKey is a preset's key: the event id, scoped by the preset's name
// and the request's method (upper-cased) and path (normalised by
// endpointPath, so it is plain ASCII). Two endpoints never share a preset's
// keys, and a method the route does not serve never replays another
// method's answer.
func endpointKey(r *http.Request, name, id string) (Key, error) {
	path := endpointPath(r.URL)
	source := name + " " + strings.ToUpper(r.Method) + " " + path
	if len(source) > MaxKeyLen {
		return Key{}, fmt.Errorf("%w: the path is too long to scope the key by endpoint (%d bytes); give the KeyFunc a fixed source with WithSource", ErrInvalidKey, len(path))
	}
	return Key{Source: source, EventID: id}, nil
}

// endpointPath spells u's path one way for all the spellings a router
// routes alike, so that /webhooks/%73tripe is the endpoint /webhooks/stripe:
// http.ServeMux and gorilla/mux route on the decoded path, chi on the path
// as sent. The path is decoded, as RFC 3986 §6.2.2 decodes escaped
// unreserved characters, and as those routers decode every escape; it is
// spelled as sent when every byte may stand unescaped in a path (letters,
// digits, -._~!$&'()*+,;=:@[] and slashes: /a%21b is /a!b), else escaped by
// net/url (upper-case hex digits). An escaped slash is decoded too:
// gorilla/mux routes /webhooks%2Fstripe to /webhooks/stripe, so it must be
// that endpoint; where a router tells /a%2Fb from /a/b, the two share a
// scope, which can turn a delivery's run into a replay, never the reverse.
// A trailing slash stays (routers redirect it or route it elsewhere).
//
// A path without escapes keeps the spelling the presets always gave it
// (u.EscapedPath(), which for such a path is u.Path or, where net/url
// refuses it as sent, its escaping).
func endpointPath(u *url.URL) string {
	if asSent(u.Path) {
		return u.Path
	}
	return (&url.URL{Path: u.Path}).EscapedPath()
}

// asSent reports whether net/url leaves a path made of s's bytes as it is
// sent: unreserved characters, sub-delimiters, ":", "@", brackets and
// slashes only.
func asSent(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("-._~!$&'()*+,;=:@[]/", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// GitHub returns the KeyFunc for GitHub webhooks: the X-GitHub-Delivery GUID,
// scoped by the X-GitHub-Hook-ID header, because every hook that fires for
// one event shares the delivery GUID, and by the endpoint (source
// "github:<hook id> POST /webhooks/github"; "github POST ..." without a hook
// id header; see WithSource).
//
// Given the hook's secrets (two while one is being changed), it first
// verifies X-Hub-Signature-256 ("sha256=<hex>", the HMAC-SHA256 of the
// body) and answers 401 (ErrSignature) to a request that fails. Without
// secrets it verifies nothing. It panics if a secret is empty.
func GitHub(secrets ...string) KeyFunc {
	return withSignature(githubSignature(secrets), func(r *http.Request, _ []byte) (Key, error) {
		id, err := singleHeader(r, "X-Github-Delivery")
		if err != nil {
			return Key{}, err
		}
		source := "github"
		switch hooks := r.Header.Values("X-Github-Hook-Id"); {
		case len(hooks) > 1:
			return Key{}, fmt.Errorf("%w: header X-Github-Hook-Id is sent more than once", ErrInvalidKey)
		case len(hooks) == 1 && hooks[0] != "":
			source = "github:" + hooks[0]
		}
		return endpointKey(r, source, id)
	})
}

// Shopify returns the KeyFunc for Shopify webhooks: the X-Shopify-Event-Id
// header, which stays the same across retries, scoped by the endpoint
// (source "shopify POST /webhooks/shopify"; see WithSource).
//
// Given the app's client secrets (two while one is being rotated), it first
// verifies X-Shopify-Hmac-Sha256 (the base64 HMAC-SHA256 of the body) and
// answers 401 (ErrSignature) to a request that fails. Without secrets it
// verifies nothing. It panics if a secret is empty.
func Shopify(secrets ...string) KeyFunc {
	return withSignature(shopifySignature(secrets), func(r *http.Request, _ []byte) (Key, error) {
		id, err := singleHeader(r, "X-Shopify-Event-Id")
		if err != nil {
			return Key{}, err
		}
		return endpointKey(r, "shopify", id)
	})
}

// StandardWebhooks returns the KeyFunc for senders that follow the Standard
// Webhooks specification (and Svix): the webhook-id header, or svix-id when
// webhook-id is absent, scoped by source (name the sender: "resend",
// "clerk") and by the endpoint (source "resend POST /webhooks/resend"; see
// WithSource).
//
// Given the endpoint's secrets ("whsec_<base64>"; two while one is being
// rotated), it first verifies webhook-signature ("v1,<base64>", several
// space-separated) over webhook-id, webhook-timestamp and the exact body,
// with a timestamp within 5 minutes of the receiver's clock (the svix-
// headers when webhook-id is absent), and answers 401 (ErrSignature) to a
// request that fails. Without secrets it verifies nothing. It panics if a
// secret is empty or not base64.
func StandardWebhooks(source string, secrets ...string) KeyFunc {
	mustSource("StandardWebhooks", source)
	return withSignature(standardWebhooksSignature(secrets, time.Now), func(r *http.Request, _ []byte) (Key, error) {
		name := "Webhook-Id"
		if len(r.Header.Values(name)) == 0 {
			name = "Svix-Id"
		}
		id, err := singleHeader(r, name)
		if err != nil {
			return Key{}, fmt.Errorf("%w (webhook-id or svix-id)", err)
		}
		return endpointKey(r, source, id)
	})
}

func mustSource(fn, source string) {
	if err := validatePart("source", source); err != nil {
		panic(fmt.Sprintf("idem: %s: %v", fn, err))
	}
}

func singleHeader(r *http.Request, name string) (string, error) {
	return oneHeader(r, name, ErrNoKey, ErrInvalidKey)
}

// oneHeader returns the one value of header name; the error wraps missing
// when it is absent or empty, twice when it is sent more than once.
func oneHeader(r *http.Request, name string, missing, twice error) (string, error) {
	vs := r.Header.Values(name)
	switch {
	case len(vs) == 0 || (len(vs) == 1 && vs[0] == ""):
		return "", fmt.Errorf("%w: header %s is missing", missing, name)
	case len(vs) > 1:
		return "", fmt.Errorf("%w: header %s is sent more than once", twice, name)
	}
	return vs[0], nil
}

// ParseIdempotencyKey parses the value of an Idempotency-Key header: an
// RFC 8941 sf-string (quoted, with \" and \\ escapes, optionally followed by
// ;parameters, which are ignored) or a bare value of visible ASCII characters
// without quotes, commas, semicolons or backslashes. The result is the key
// without quotes or escapes. Errors wrap ErrInvalidKey.
func ParseIdempotencyKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" {
		return "", fmt.Errorf("%w: Idempotency-Key is empty", ErrNoKey)
	}
	if v[0] != '"' {
		for i := 0; i < len(v); i++ {
			c := v[i]
			if c <= ' ' || c >= 0x7f || c == '"' || c == ',' || c == ';' || c == '\\' {
				return "", fmt.Errorf("%w: Idempotency-Key must be a quoted string or a bare token", ErrInvalidKey)
			}
		}
		return v, nil
	}
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", fmt.Errorf("%w: Idempotency-Key has an invalid escape", ErrInvalidKey)
			}
			b.WriteByte(v[i])
		case c == '"':
			rest := strings.TrimLeft(v[i+1:], " \t")
			if rest != "" && rest[0] != ';' {
				return "", fmt.Errorf("%w: Idempotency-Key has text after the closing quote", ErrInvalidKey)
			}
			return b.String(), nil
		case c < 0x20 || c >= 0x7f:
			return "", fmt.Errorf("%w: Idempotency-Key must be printable ASCII", ErrInvalidKey)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: Idempotency-Key has no closing quote", ErrInvalidKey)
}

// jsonField finds the string (or, unless stringOnly, number) at path in
// body without decoding the whole document into maps. The body must be
// valid JSON as a whole, and no object on the path may carry the wanted key
// twice.
func jsonField(r *http.Request, body []byte, path []string, stringOnly bool) (string, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return "", fmt.Errorf("%w: the request has no body; the key is read from its JSON field %s", ErrBadBody, dotted(path))
	}
	// RFC 8259: JSON exchanged between systems is UTF-8. encoding/json
	// would quietly turn invalid bytes into U+FFFD, and two different bodies
	// into the same id.
	if !utf8.Valid(body) || !json.Valid(body) {
		if ct := r.Header.Get("Content-Type"); ct != "" && !strings.Contains(strings.ToLower(ct), "json") {
			return "", fmt.Errorf("%w: the body is not valid JSON (nor is it sent as JSON)", ErrBadBody)
		}
		return "", fmt.Errorf("%w: the body is not valid JSON", ErrBadBody)
	}
	sc := jsonScan{b: body}
	id, found, err := sc.findField(path, 0, stringOnly)
	if err != nil {
		return "", err
	}
	if !found {
		return "", fmt.Errorf("%w: field %s is missing", ErrNoKey, dotted(path))
	}
	return id, nil
}

// jsonScan walks a body that json.Valid has accepted, so it needs no error
// handling of its own: it skips values without decoding them, and decodes
// only the names of the objects on the path and the value found. A key
// costs one pass over the body and no allocation per value, however many
// values a hostile body holds (encoding/json's Decoder.Token allocates for
// each).
type jsonScan struct {
	b []byte
	i int
}

// findField reads one whole JSON value, which must be an object, and looks
// for path[depth:] inside it. encoding/json matches a field's name without
// regard to case (an exact match first; of two, the later wins): a name
// that matches path[depth] in another case counts as the field appearing
// again, so a body that encoding/json could read two ways is refused.
func (s *jsonScan) findField(path []string, depth int, stringOnly bool) (id string, found bool, err error) {
	s.space()
	if s.b[s.i] != '{' {
		return "", false, fmt.Errorf("%w: %s is not a JSON object", ErrInvalidKey, dotted(path[:depth]))
	}
	s.i++
	seg := []byte(path[depth])
	seen := 0 // names equal to seg in any case
	for {
		s.space()
		switch s.b[s.i] {
		case '}':
			s.i++
			return id, found, nil
		case ',':
			s.i++
			s.space()
		}
		name := s.name()
		s.space()
		s.i++ // the colon
		if !bytes.EqualFold(name, seg) {
			s.skip()
			continue
		}
		if seen++; seen > 1 {
			return "", false, fmt.Errorf("%w: field %s appears more than once (names are matched in any case)", ErrInvalidKey, dotted(path[:depth+1]))
		}
		if !bytes.Equal(name, seg) {
			s.skip() // another case of the name: only an exact one is the key
			continue
		}
		found = true
		if depth+1 < len(path) {
			var sub bool
			if id, sub, err = s.findField(path, depth+1, stringOnly); err != nil {
				return "", false, err
			}
			if !sub {
				return "", false, fmt.Errorf("%w: field %s is missing", ErrNoKey, dotted(path))
			}
			continue
		}
		if id, err = s.leaf(path, stringOnly); err != nil {
			return "", false, err
		}
	}
}

// leaf reads the value found at path: a string, or a number's literal text.
func (s *jsonScan) leaf(path []string, stringOnly bool) (string, error) {
	s.space()
	switch c := s.b[s.i]; {
	case c == '"':
		return s.str(), nil
	case c == '-' || ('0' <= c && c <= '9'):
		if stringOnly {
			return "", fmt.Errorf("%w: field %s must be a string", ErrInvalidKey, dotted(path))
		}
		start := s.i
		s.literal()
		return string(s.b[start:s.i]), nil
	}
	return "", fmt.Errorf("%w: field %s must be a string or a number", ErrInvalidKey, dotted(path))
}

func (s *jsonScan) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// rawString moves past the string at s.i and returns what is between its
// quotes, still escaped, and whether it has escapes.
func (s *jsonScan) rawString() (raw []byte, escaped bool) {
	s.i++ // the opening quote
	start := s.i
	for {
		switch s.b[s.i] {
		case '"':
			s.i++
			return s.b[start : s.i-1], escaped
		case '\\':
			escaped = true
			s.i += 2
		default:
			s.i++
		}
	}
}

// str reads the string at s.i, decoded as encoding/json decodes it.
func (s *jsonScan) str() string {
	start := s.i
	if raw, escaped := s.rawString(); !escaped {
		return string(raw)
	}
	var v string
	_ = json.Unmarshal(s.b[start:s.i], &v) // valid: the body is
	return v
}

// name reads an object's member name, decoded; without allocating, unless
// it has escapes.
func (s *jsonScan) name() []byte {
	start := s.i
	raw, escaped := s.rawString()
	if !escaped {
		return raw
	}
	s.i = start
	return []byte(s.str())
}

// literal moves past a number, true, false or null.
func (s *jsonScan) literal() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return
		}
		s.i++
	}
}

// skip moves past one whole value.
func (s *jsonScan) skip() {
	depth := 0
	for {
		s.space()
		switch s.b[s.i] {
		case '"':
			s.rawString()
		case '{', '[':
			depth++
			s.i++
		case '}', ']':
			depth--
			s.i++
		case ',', ':':
			s.i++
			continue
		default:
			s.literal()
		}
		if depth == 0 {
			return
		}
	}
}

func dotted(path []string) string {
	if len(path) == 0 {
		return "the body"
	}
	return fmt.Sprintf("%q", strings.Join(path, "."))
}

// validateKey applies the rules every Key must pass before it reaches SQL.
func validateKey(k Key) error {
	if err := validatePart("source", k.Source); err != nil {
		return err
	}
	return validatePart("event id", k.EventID)
}

func validatePart(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: the %s is empty", ErrNoKey, what)
	case len(s) > MaxKeyLen:
		return fmt.Errorf("%w: the %s is longer than %d bytes", ErrInvalidKey, what, MaxKeyLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: the %s is not valid UTF-8", ErrInvalidKey, what)
	}
	for _, c := range s {
		if c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) {
			return fmt.Errorf("%w: the %s contains a control character", ErrInvalidKey, what)
		}
	}
	return nil
}
