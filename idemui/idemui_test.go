package idemui_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem/idemui"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ui starts the handler on table, mounted under /admin/idem/ of a test
// server, with a first snapshot taken.
func ui(t *testing.T, table string, opts idemui.Options) (*idemui.Handler, *httptest.Server) {
	t.Helper()
	opts.Table = table
	h, err := idemui.New(db, opts)
	require.NoError(t, err)
	t.Cleanup(h.Close)
	require.NoError(t, h.Refresh(context.Background()))
	mux := http.NewServeMux()
	mux.Handle("/admin/idem/", http.StripPrefix("/admin/idem", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return h, srv
}

// client follows no redirects, so tests see them.
var client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func get(t *testing.T, srv *httptest.Server, path string) (int, string) {
	t.Helper()
	resp, err := client.Get(srv.URL + "/admin/idem/" + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func post(t *testing.T, srv *httptest.Server, form url.Values, header http.Header) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/admin/idem/release", strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(b)
}

func keyPath(source, id string) string {
	return "key?" + url.Values{"source": {source}, "id": {id}}.Encode()
}

func TestPages(t *testing.T) {
	t.Parallel()
	for _, layout := range []struct {
		name        string
		partitioned bool
	}{{"plain", false}, {"partitioned", true}} {
		t.Run("on a "+layout.name+" table", func(t *testing.T) {
			t.Parallel()
			table := newTable(t, layout.partitioned)
			_, srv := ui(t, table, idemui.Options{})

			t.Run("the overview shows the counts, the chart, the sources and the durability", func(t *testing.T) {
				code, body := get(t, srv, "")
				require.Equal(t, http.StatusOK, code)
				assert.Contains(t, body, `<span class="n" id="keys">6</span>`)
				assert.Contains(t, body, `<span class="n" id="unanswered">1</span>`)
				assert.Contains(t, body, `<span class="n" id="expired">1</span>`)
				assert.Contains(t, body, `<svg id="chart"`)
				assert.Equal(t, 1, strings.Count(body, `<rect class="bar"`), "one bar per hour with claims")
				assert.Regexp(t, `<rect class="bar" x="719" y="0" width="1" height="120"><title>[0-9-]+ [0-9]+:00Z: 6 claims</title>`, body, "this hour's bar, full height")
				assert.Contains(t, body, "no synchronous standby")
				assert.Contains(t, body, "unanswered_keys")
				assert.Contains(t, body, `href="keys?state=all&amp;source=stripe"`)
				assert.Contains(t, body, "3 keys · p50")
				if layout.partitioned {
					assert.Contains(t, body, `<table id="partitions">`)
				} else {
					assert.NotContains(t, body, `id="partitions"`)
				}
			})
			t.Run("a key's page shows its state, without its body", func(t *testing.T) {
				code, body := get(t, srv, keyPath("stripe", "evt_done"))
				require.Equal(t, http.StatusOK, code)
				assert.Contains(t, body, `<b>completed</b>`)
				assert.Contains(t, body, `<dd id="status-code">200</dd>`)
				assert.Contains(t, body, "11 bytes (hidden")
				assert.Contains(t, body, "application/json")
				assert.NotContains(t, body, `{&#34;ok&#34;:true}`)
				assert.NotContains(t, body, `id="release"`, "read-only: no release")
				for id, state := range map[string]string{"evt_unanswered": "unanswered", "evt_expired": "lease_expired", "evt_leased": "leased"} {
					code, body := get(t, srv, keyPath("stripe", id))
					assert.Equal(t, http.StatusOK, code)
					assert.Contains(t, body, "<b>"+state+"</b>", id)
				}
				code, body = get(t, srv, keyPath("stripe", "nothing"))
				assert.Equal(t, http.StatusNotFound, code)
				assert.Contains(t, body, `id="not-found"`)
			})
			t.Run("the search finds an event id under every source, or opens the key with a source", func(t *testing.T) {
				code, body := get(t, srv, "search?id=evt_done")
				require.Equal(t, http.StatusOK, code)
				assert.Contains(t, body, `href="key?source=github&amp;id=evt_done"`)
				assert.Contains(t, body, `href="key?source=stripe&amp;id=evt_done"`)
				code, body = get(t, srv, "search?id=nothing")
				assert.Equal(t, http.StatusOK, code)
				assert.Contains(t, body, "No committed key")
				resp, err := client.Get(srv.URL + "/admin/idem/search?source=stripe&id=evt_done")
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, http.StatusSeeOther, resp.StatusCode)
				assert.Equal(t, "key?source=stripe&id=evt_done", resp.Header.Get("Location"))
			})
			t.Run("the problem lists", func(t *testing.T) {
				_, body := get(t, srv, "keys")
				assert.Contains(t, body, "evt_unanswered")
				assert.Contains(t, body, "evt_expired")
				assert.NotContains(t, body, "evt_leased")
				_, body = get(t, srv, "keys?state=leased")
				assert.Contains(t, body, "evt_leased")
				assert.NotContains(t, body, "evt_expired")
				code, _ := get(t, srv, "keys?state=bogus")
				assert.Equal(t, http.StatusBadRequest, code)
			})
			t.Run("read-only: there is no release", func(t *testing.T) {
				code, _ := get(t, srv, "release?source=stripe&id=evt_done")
				assert.Equal(t, http.StatusNotFound, code)
				resp, _ := post(t, srv, url.Values{"source": {"stripe"}, "id": {"evt_done"}}, nil)
				assert.Equal(t, http.StatusNotFound, resp.StatusCode)
			})
		})
	}
}

// Keys and sources are chosen by whoever sends requests: every page
// renders them as text.
func TestEverythingIsEscaped(t *testing.T) {
	t.Parallel()
	table := newTable(t, false)
	_, srv := ui(t, table, idemui.Options{ShowBodies: true, AllowRelease: true})
	raw := regexp.MustCompile(`<script|<img|<b>evil`)
	for path, want := range map[string]string{
		"": "&lt;b&gt;evil&lt;/b&gt;",
		keyPath("<b>evil</b>", "<script>alert(1)</script>"):         "&lt;script&gt;alert(1)",
		"search?id=" + url.QueryEscape("<script>alert(1)</script>"): "&lt;script&gt;alert(1)",
		"keys?state=all": "&lt;script&gt;alert(1)",
		"release?" + url.Values{"source": {"<b>evil</b>"}, "id": {"<script>alert(1)</script>"}}.Encode(): "&lt;script&gt;alert(1)",
		"search?id=" + url.QueryEscape(`"><script>alert(4)</script>`):                                    "&#34;&gt;&lt;script&gt;alert(4)",
	} {
		code, body := get(t, srv, path)
		assert.Less(t, code, 500, path)
		assert.Empty(t, raw.FindAllString(body, -1), "%s renders markup raw", path)
		assert.True(t, strings.Contains(body, want), "%s shows %s", path, want)
	}
	_, body := get(t, srv, keyPath("<b>evil</b>", "<script>alert(1)</script>"))
	assert.True(t, strings.Contains(body, `<pre id="body">&lt;script&gt;alert(3)&lt;/script&gt;</pre>`), "the body shown, as text")
	assert.True(t, strings.Contains(body, `&lt;img src=x onerror=alert(2)&gt;`), "the header shown, as text")
	assert.True(t, strings.Contains(body, `href="release?source=%3cb%3eevil%3c%2fb%3e&amp;id=%3cscript%3ealert%281%29%3c%2fscript%3e"`), "the link escaped")
}

func TestBodiesOnlyWhenConfigured(t *testing.T) {
	t.Parallel()
	table := newTable(t, false)
	_, srv := ui(t, table, idemui.Options{ShowBodies: true})
	_, body := get(t, srv, keyPath("stripe", "evt_done"))
	assert.Contains(t, body, `<pre id="body">{&#34;ok&#34;:true}</pre>`)
}

// token reads the release token of the confirmation page of a key.
func token(t *testing.T, srv *httptest.Server, source, id string) string {
	t.Helper()
	code, body := get(t, srv, "release?"+url.Values{"source": {source}, "id": {id}}.Encode())
	require.Equal(t, http.StatusOK, code, body)
	m := regexp.MustCompile(`name="token" value="([^"]+)"`).FindStringSubmatch(body)
	require.NotNil(t, m, body)
	return m[1]
}

func TestRelease(t *testing.T) {
	t.Parallel()
	table := newTable(t, true)
	_, srv := ui(t, table, idemui.Options{AllowRelease: true})

	_, body := get(t, srv, keyPath("stripe", "evt_done"))
	assert.Contains(t, body, `id="release" href="release?source=stripe&amp;id=evt_done"`)

	form := url.Values{"source": {"stripe"}, "id": {"evt_done"}}
	t.Run("without the token it is refused", func(t *testing.T) {
		resp, body := post(t, srv, form, nil)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode)
		assert.Contains(t, body, "token is missing")
		form := url.Values{"source": {"stripe"}, "id": {"evt_done"}, "token": {token(t, srv, "stripe", "evt_unanswered")}}
		resp, _ = post(t, srv, form, nil)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "a token for another key")
		form.Set("token", "AAAA"+form.Get("token")[4:])
		resp, _ = post(t, srv, form, nil)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "a forged token")
	})
	t.Run("a token for the key as it was is refused once the key changed", func(t *testing.T) {
		form := url.Values{"source": {"stripe"}, "id": {"evt_unanswered"}, "token": {token(t, srv, "stripe", "evt_unanswered")}}
		// Meanwhile the key is answered (a takeover that completed, say).
		_, err := db.Exec(`UPDATE "` + table + `" SET response_status = 201, response_body = 'late', completed_at = now()
			WHERE source = 'stripe' AND event_id = 'evt_unanswered'`)
		require.NoError(t, err)
		resp, body := post(t, srv, form, nil)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode)
		assert.Contains(t, body, "changed since")
		code, _ := get(t, srv, keyPath("stripe", "evt_unanswered"))
		assert.Equal(t, http.StatusOK, code, "still there")
	})
	t.Run("a cross-site post is refused, even with a token", func(t *testing.T) {
		form := url.Values{"source": {"stripe"}, "id": {"evt_done"}, "token": {token(t, srv, "stripe", "evt_done")}}
		resp, _ := post(t, srv, form, http.Header{"Sec-Fetch-Site": {"cross-site"}})
		assert.Equal(t, http.StatusForbidden, resp.StatusCode)
		code, _ := get(t, srv, keyPath("stripe", "evt_done"))
		assert.Equal(t, http.StatusOK, code, "still there")
	})
	t.Run("with the token it deletes the key", func(t *testing.T) {
		form := url.Values{"source": {"stripe"}, "id": {"evt_done"}, "token": {token(t, srv, "stripe", "evt_done")}}
		resp, _ := post(t, srv, form, http.Header{"Sec-Fetch-Site": {"same-origin"}})
		assert.Equal(t, http.StatusSeeOther, resp.StatusCode)
		assert.Equal(t, "key?source=stripe&id=evt_done&done=released", resp.Header.Get("Location"))
		code, body := get(t, srv, resp.Header.Get("Location"))
		assert.Equal(t, http.StatusOK, code)
		assert.Contains(t, body, `id="released"`)
		code, _ = get(t, srv, keyPath("stripe", "evt_done"))
		assert.Equal(t, http.StatusNotFound, code)
	})
	t.Run("a live lease is refused unless forced", func(t *testing.T) {
		form := url.Values{"source": {"stripe"}, "id": {"evt_leased"}, "token": {token(t, srv, "stripe", "evt_leased")}}
		resp, body := post(t, srv, form, nil)
		assert.Equal(t, http.StatusConflict, resp.StatusCode)
		assert.Contains(t, body, `id="refused"`)
		assert.Contains(t, body, "live lease")
		form.Set("force", "on")
		resp, _ = post(t, srv, form, nil)
		assert.Equal(t, http.StatusSeeOther, resp.StatusCode)
	})
}

func TestNewRefusesBadOptions(t *testing.T) {
	t.Parallel()
	_, err := idemui.New(db, idemui.Options{Table: "no_such_table"})
	assert.ErrorContains(t, err, "does not exist")
	_, err = idemui.New(db, idemui.Options{Table: "Bad Name"})
	assert.Error(t, err)
	_, err = idemui.New(db, idemui.Options{RefreshEvery: -1})
	assert.Error(t, err)
	_, err = idemui.New(nil, idemui.Options{})
	assert.Error(t, err)
}

// The problem lists come from the snapshot; a key released from the UI
// leaves them at once, and a later page (before=...) reads the table.
func TestProblemListsFromTheSnapshot(t *testing.T) {
	t.Parallel()
	table := newTable(t, false)
	_, srv := ui(t, table, idemui.Options{AllowRelease: true})
	_, err := db.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, claimed_at) VALUES ('stripe', 'evt_later', '\x00', now())`)
	require.NoError(t, err)
	_, body := get(t, srv, "keys?state=unanswered")
	assert.Contains(t, body, "evt_unanswered")
	assert.NotContains(t, body, "evt_later", "committed after the snapshot")
	assert.Contains(t, body, "as of the snapshot of")
	_, body = get(t, srv, "keys?state=unanswered&before="+url.QueryEscape(time.Now().Add(time.Minute).UTC().Format(time.RFC3339Nano)))
	assert.Contains(t, body, "evt_later", "read from the table")

	form := url.Values{"source": {"stripe"}, "id": {"evt_unanswered"}, "token": {token(t, srv, "stripe", "evt_unanswered")}}
	resp, _ := post(t, srv, form, nil)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, body = get(t, srv, "keys?state=unanswered")
	assert.NotContains(t, body, "evt_unanswered")
}

// A refresh that fails keeps the last snapshot, and says so without the
// error's text.
func TestAFailedRefreshKeepsTheLastSnapshot(t *testing.T) {
	t.Parallel()
	table := newTable(t, false)
	h, srv := ui(t, table, idemui.Options{})
	_, err := db.Exec(`ALTER TABLE "` + table + `" RENAME TO "` + table + `_gone"`)
	require.NoError(t, err)
	require.Error(t, h.Refresh(context.Background()))
	code, body := get(t, srv, "")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "The last refresh failed: the database did not answer")
	assert.Contains(t, body, `<span class="n" id="keys">6</span>`, "the last snapshot")
	assert.NotContains(t, body, "does not exist")
}
