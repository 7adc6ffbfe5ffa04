package idem

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestHeaderJSONRoundTrip(t *testing.T) {
	h := http.Header{
		"Content-Type": {"application/json; charset=utf-8"},
		"Link":         {`</a>; rel="next"`, "</b>; rel=\"prev\"\t"},
		"Etag":         {"W/\"\\x\u00e9\x01\""},
		"Vary":         {"a\x00b", "Accept"},
		"Ignored":      {"not on the list"},
	}
	b := appendHeaderJSON(nil, h, []string{"Content-Type", "Link", "Etag", "Vary", "Missing"})
	var viaStdlib map[string][]string
	require.NoError(t, json.Unmarshal(b, &viaStdlib), "valid JSON: %s", b)
	got, err := parseHeaderJSON(b)
	require.NoError(t, err)
	assert.Equal(t, http.Header(viaStdlib), got)
	assert.Equal(t, h["Link"], got["Link"])
	assert.Equal(t, h["Etag"], got["Etag"])
	assert.Equal(t, []string{"Accept"}, got["Vary"], "a value with NUL is not stored: jsonb cannot hold it")
	assert.NotContains(t, got, "Ignored")
	assert.Equal(t, []byte(`{}`), appendHeaderJSON(nil, h, nil))
}

func TestHeaderJSONInvalidUTF8BecomesReplacementChar(t *testing.T) {
	got, err := parseHeaderJSON(appendHeaderJSON(nil, http.Header{"X": {"a\xffb"}}, []string{"X"}))
	require.NoError(t, err)
	assert.Equal(t, "a\ufffdb", got.Get("X"))
}

func TestParseHeaderJSONRejectsOtherShapes(t *testing.T) {
	for _, in := range []string{``, `[]`, `{"a":"b"}`, `{"a":[1]}`, `{"a":["b"]`, `{"a":["b"],}`, `null`} {
		_, err := parseHeaderJSON([]byte(in))
		assert.Error(t, err, in)
	}
}

func TestParseHeaderJSONReadsJSONBOutput(t *testing.T) {
	// jsonb's normalized form, escapes as PostgreSQL writes them, and
	// surrogate pairs.
	got, err := parseHeaderJSON([]byte(`{"A": ["x\\y\"z", "\u00e9\ud83d\ude00\t"], "Empty": []}`))
	require.NoError(t, err)
	assert.Equal(t, []string{`x\y"z`, "é😀\t"}, got["A"])
	assert.Empty(t, got["Empty"])
	got, err = parseHeaderJSON([]byte(`{"B":["\ud800x"]}`))
	require.NoError(t, err)
	assert.Equal(t, "\ufffdx", got.Get("B"), "a lone surrogate becomes U+FFFD, as encoding/json does")
}

func FuzzParseHeaderJSON(f *testing.F) {
	f.Add([]byte(`{"A": ["b", "c"]}`))
	f.Add([]byte(`{"A":["\u00e9\ud83d\ude00\ud800"]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := parseHeaderJSON(b)
		var std map[string][]string
		stdErr := json.Unmarshal(b, &std)
		if err != nil {
			return // stricter than encoding/json is fine: only our own output is read
		}
		if stdErr != nil {
			t.Fatalf("accepted what encoding/json rejects: %q", b)
		}
		for k, vs := range got {
			if len(vs) != len(std[k]) {
				t.Fatalf("%q: %q != %q", b, vs, std[k])
			}
			for i := range vs {
				if vs[i] != std[k][i] {
					t.Fatalf("%q: %q != %q", b, vs[i], std[k][i])
				}
			}
		}
	})
}

func FuzzHeaderJSON(f *testing.F) {
	f.Add("text/plain", "</a>; rel=\"x\"")
	f.Add("\x00", "\xff\xfe")
	f.Fuzz(func(t *testing.T, a, b string) {
		h := http.Header{"A": {a, b}, "B": {b}}
		enc := appendHeaderJSON(nil, h, []string{"A", "B"})
		var std map[string][]string
		if err := json.Unmarshal(enc, &std); err != nil {
			t.Fatalf("invalid JSON %q: %v", enc, err)
		}
		got, err := parseHeaderJSON(enc)
		if err != nil {
			t.Fatal(err)
		}
		if len(got["B"]) > 0 && got["B"][0] != std["B"][0] {
			t.Fatalf("parse %q != stdlib %q", got["B"][0], std["B"][0])
		}
	})
}
