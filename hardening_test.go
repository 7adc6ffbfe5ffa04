package idem_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Issue 28's findings, each as the attack that showed it.

// HTTP methods are case-sensitive tokens, and a route registered without a
// method receives `post` as well as `POST`: a spelling of a covered method
// is that method, claimed, and its duplicates are replays.
func TestMethodSpellingsOfACoveredMethodAreClaimed(t *testing.T) {
	t.Parallel()
	for name, kf := range map[string]idem.KeyFunc{
		"a preset, scoped by method": idem.Stripe(),
		"a header key":               idem.Header("test", "X-Event-Id"),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			mux := http.NewServeMux()
			f := newFixture(t, idem.Options{KeyFunc: kf}, mux)
			mux.Handle("/webhooks/stripe", f.ledgerHandler()) // no method in the pattern
			const event = `{"id":"evt_method","type":"charge.succeeded"}`
			send := func(method string) reply {
				req, err := http.NewRequest(method, f.srv.URL+"/webhooks/stripe", strings.NewReader(event))
				require.NoError(t, err)
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Event-Id", "evt_method")
				return f.send(req)
			}
			first := send(http.MethodPost)
			require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
			for _, m := range []string{"post", "Post", "pOST"} {
				again := send(m)
				assert.Equal(t, http.StatusCreated, again.status, "%s: %s", m, again.body)
				assert.Equal(t, first.body, again.body, "%s replays the POST's answer", m)
				assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"), m)
			}
			assert.Equal(t, int64(1), f.runs.Load(), "the handler ran once")
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, 1, f.keys())
		})
	}

	// A first delivery spelled `post` is claimed too: the handler has its
	// transaction (idem.Tx reports true), and the key is stored.
	mux := http.NewServeMux()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, mux)
	mux.Handle("/hook", f.ledgerHandler())
	r := f.postTo("post", "/hook", `{"id":"evt_lower"}`)
	require.Equal(t, http.StatusCreated, r.status, "the handler had its transaction: %s", r.body)
	var source string
	require.NoError(t, f.db.QueryRow(`SELECT source FROM "`+f.table+`"`).Scan(&source))
	assert.Equal(t, "stripe POST /hook", source, "the method is upper-cased in the scope")
}
