package idemui

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// The pages, each rendered from assets/layout.html and its own template.
var pageFiles = []string{"overview", "search", "key", "keys", "release", "message"}

func parsePages() (map[string]*template.Template, error) {
	pages := map[string]*template.Template{}
	for _, p := range pageFiles {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(assets, "assets/layout.html", "assets/"+p+".html")
		if err != nil {
			return nil, fmt.Errorf("idem: idemui: template %s: %w", p, err)
		}
		pages[p] = t
	}
	return pages, nil
}

var funcs = template.FuncMap{
	"stamp": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"since": func(now, t time.Time) string { return roundDuration(now.Sub(t)) },
	"dur":   roundDuration,
	"size":  size,
	"keyURL": func(k idem.Key) string {
		return "key?source=" + queryEscape(k.Source) + "&id=" + queryEscape(k.EventID)
	},
	"pct": func(n, m int64) string {
		if m == 0 {
			return "0"
		}
		return strconv.FormatFloat(float64(n)*100/float64(m), 'f', 1, 64)
	},
}

// routes maps the paths to their pages. Release is routed only when
// allowed: a read-only UI answers 404 there, as for any other path.
func (h *Handler) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", h.overview)
	mux.HandleFunc("GET /search", h.search)
	mux.HandleFunc("GET /key", h.key)
	mux.HandleFunc("GET /keys", h.keys)
	mux.HandleFunc("GET /style.css", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "max-age=3600")
		http.ServeFileFS(w, r, assets, "assets/style.css")
	})
	if h.opts.AllowRelease {
		mux.HandleFunc("GET /release", h.confirmRelease)
		// Go's cross-origin protection refuses a POST that a browser
		// says comes from another origin (Sec-Fetch-Site, Origin); the
		// signed token of the confirmation page refuses the rest.
		mux.Handle("POST /release", http.NewCrossOriginProtection().Handler(http.HandlerFunc(h.release)))
	}
	return mux
}

// page is what every template gets.
type page struct {
	Title        string
	Table        string
	AllowRelease bool
	ShowBodies   bool
	Data         any
}

// render writes the page named name with status.
func (h *Handler) render(w http.ResponseWriter, status int, name, title string, data any) {
	var buf bytes.Buffer
	table := h.opts.Table
	if table == "" {
		table = idem.DefaultTable
	}
	err := h.pages[name].Execute(&buf, page{Title: title, Table: table, AllowRelease: h.opts.AllowRelease, ShowBodies: h.opts.ShowBodies, Data: data})
	if err != nil {
		h.log.Error("idem: idemui: render", "page", name, "error", err)
		http.Error(w, "rendering the page failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail renders a database error without its text (it can hold the DSN's
// host, or SQL): the log has it.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, err error) {
	status := http.StatusInternalServerError
	msg := "The database could not answer; the server's log has the error."
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		status, msg = http.StatusServiceUnavailable, "The database did not answer in time."
	}
	h.log.Error("idem: idemui: page failed", "path", r.URL.Path, "error", err)
	h.render(w, status, "message", "Error", msg)
}

// overviewData is the overview page's data.
type overviewData struct {
	Snap     *snapshot
	Bars     []bar
	Severity string
}

// bar is one hour of the chart.
type bar struct {
	X, Y, W, H float64
	Title      string
}

const chartW, chartH = 720.0, 120.0

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	s := h.snapshotNow()
	d := overviewData{Snap: s}
	if s != nil && s.Report != nil {
		d.Severity = s.Report.Severity().String()
		bw := chartW / float64(len(s.Hours))
		for i, hc := range s.Hours {
			if hc.Count == 0 {
				continue // the background shows through
			}
			bh := float64(hc.Count) / float64(s.MaxHour) * chartH
			d.Bars = append(d.Bars, bar{X: float64(i) * bw, Y: chartH - bh, W: bw, H: bh,
				Title: fmt.Sprintf("%s: %d claims", hc.Hour.UTC().Format("2006-01-02 15:00Z"), hc.Count)})
		}
	}
	h.render(w, http.StatusOK, "overview", "Overview", d)
}

// searchData is the search page's data.
type searchData struct {
	Source, ID string
	Searched   bool
	Found      []idemops.KeyInfo
	Sources    []string
}

func (h *Handler) search(w http.ResponseWriter, r *http.Request) {
	d := searchData{Source: r.FormValue("source"), ID: r.FormValue("id")}
	if s := h.snapshotNow(); s != nil {
		d.Sources = s.Sources
	}
	if d.ID != "" {
		if d.Source != "" {
			seeOther(w, "key?source="+queryEscape(d.Source)+"&id="+queryEscape(d.ID))
			return
		}
		found, err := idemops.FindKeys(r.Context(), h.db, h.opts.Table, d.ID)
		if err != nil {
			h.fail(w, r, err)
			return
		}
		d.Searched, d.Found = true, found
	}
	h.render(w, http.StatusOK, "search", "Search", d)
}

// keyData is the key page's data.
type keyData struct {
	Key      idem.Key
	Info     *idemops.KeyInfo
	Headers  []header
	Body     string
	BodyUTF8 bool
	Message  string
}

type header struct{ Name, Value string }

func (h *Handler) key(w http.ResponseWriter, r *http.Request) {
	k := idem.Key{Source: r.FormValue("source"), EventID: r.FormValue("id")}
	d := keyData{Key: k, Message: r.FormValue("done")}
	info, err := idemops.ShowKey(r.Context(), h.db, idemops.KeyOptions{Table: h.opts.Table, Key: k, Body: h.opts.ShowBodies})
	switch {
	case errors.Is(err, idemops.ErrKeyNotFound) && d.Message == "released":
		h.render(w, http.StatusOK, "key", "Key released", d)
		return
	case errors.Is(err, idemops.ErrKeyNotFound):
		h.render(w, http.StatusNotFound, "key", "Key not found", d)
		return
	case err != nil:
		h.fail(w, r, err)
		return
	}
	d.Info = info
	d.Headers = sortedHeaders(info.Headers)
	if h.opts.ShowBodies && info.Body != nil {
		d.BodyUTF8 = utf8.Valid(info.Body)
		if d.BodyUTF8 {
			d.Body = string(info.Body)
		} else {
			d.Body = fmt.Sprintf("%x", info.Body)
		}
	}
	h.render(w, http.StatusOK, "key", "Key", d)
}

func sortedHeaders(hs http.Header) []header {
	var out []header
	for n, vs := range hs {
		for _, v := range vs {
			out = append(out, header{n, v})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// keysData is the problem list's data.
type keysData struct {
	State  string
	Source string
	States []string
	Keys   []idemops.KeyInfo
	Now    time.Time
	More   string // the link to the next page, "" when this is the last
	// Snapshot is when the snapshot the list comes from was taken; zero
	// when it was read now.
	Snapshot time.Time
}

const listLimit = 50

func (h *Handler) keys(w http.ResponseWriter, r *http.Request) {
	d := keysData{State: r.FormValue("state"), Source: r.FormValue("source"),
		States: []string{"stuck", "unanswered", "expired", "leased", "all"}}
	if d.State == "" {
		d.State = "stuck"
	}
	opts := idemops.ListOptions{Table: h.opts.Table, State: idemops.ListState(d.State), Source: d.Source, Limit: listLimit}
	if b := r.FormValue("before"); b != "" {
		t, err := time.Parse(time.RFC3339Nano, b)
		if err != nil {
			h.render(w, http.StatusBadRequest, "message", "Bad request", "The before parameter is not an RFC 3339 time.")
			return
		}
		opts.Before = t
	}
	if !validState(d.State) {
		h.render(w, http.StatusBadRequest, "message", "Bad request", "Unknown state: choose stuck, unanswered, expired, leased or all.")
		return
	}
	var keys []idemops.KeyInfo
	if s := h.snapshotNow(); s != nil && s.Report != nil && opts.State != idemops.ListAll && opts.Before.IsZero() {
		// Keys without an answer are rare, and finding them on a large
		// table takes a scan: the first page comes from the snapshot.
		keys = s.openKeys(opts.State, opts.Source, listLimit)
		d.Snapshot, d.Now = s.TakenAt, s.TakenAt
	} else {
		var err error
		if keys, err = idemops.ListKeys(r.Context(), h.db, opts); err != nil {
			h.fail(w, r, err)
			return
		}
		if len(keys) > 0 {
			d.Now = keys[0].CheckedAt
		}
	}
	d.Keys = keys
	if len(keys) == listLimit {
		d.More = "keys?state=" + queryEscape(d.State) + "&source=" + queryEscape(d.Source) +
			"&before=" + queryEscape(keys[len(keys)-1].ClaimedAt.UTC().Format(time.RFC3339Nano))
	}
	h.render(w, http.StatusOK, "keys", "Keys: "+d.State, d)
}

func validState(s string) bool {
	switch idemops.ListState(s) {
	case idemops.ListAll, idemops.ListStuck, idemops.ListUnanswered, idemops.ListExpired, idemops.ListLeased:
		return true
	}
	return false
}

// seeOther redirects to a path relative to the current page: unlike
// http.Redirect, it leaves it relative, so that the browser resolves it
// under the prefix the handler is mounted at.
func seeOther(w http.ResponseWriter, rel string) {
	w.Header().Set("Location", rel)
	w.WriteHeader(http.StatusSeeOther)
}

// queryEscape escapes a query parameter's value.
func queryEscape(s string) string {
	var b strings.Builder
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

func roundDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + roundDuration(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < 48*time.Hour:
		return d.Round(time.Second).String()
	}
	days := d / (24 * time.Hour)
	return fmt.Sprintf("%dd%dh", days, (d-days*24*time.Hour)/time.Hour)
}

func size(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}
