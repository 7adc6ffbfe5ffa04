package browsertest

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The operator UI in a real browser: Debian's headless Chromium, driven by
// chromedp, against handlers on a loopback test server and a PostgreSQL
// table with a key in each state. Each page is kept as a screenshot in
// $IDEM_SCREENSHOTS, or else in a new directory under the system's
// temporary directory that the test logs.

var (
	db       *sql.DB
	shotsDir string
)

func TestMain(m *testing.M) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	u, drop, err := createDatabase("idemui_browser")
	if err != nil {
		fmt.Fprintln(os.Stderr, "browser tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	if db, err = sql.Open("pgx", u); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "browser tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "browser tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const xssID = "<script>alert(1)</script>"

// newTable migrates a table partitioned by day and commits a key in each
// state, all claimed in the last minute (and a few hours of history for
// the chart).
func newTable(t *testing.T, name string) {
	t.Helper()
	require.NoError(t, idem.MigrateWith(context.Background(), db, idem.MigrateOptions{Table: name}))
	_, err := db.Exec(`INSERT INTO "`+name+`" (source, event_id, payload_digest, response_status, response_headers, response_body,
    claimed_at, completed_at, lease_until, lease_token) VALUES
('stripe POST /webhooks/stripe', 'evt_1QxYz', sha256('{}'::bytea), 200, '{"Content-Type": ["application/json"]}', '{"received":true}', now() - interval '50 seconds', now() - interval '49.97 seconds', NULL, NULL),
('github POST /webhooks/github', 'evt_1QxYz', '\x00', 202, '{}', '', now() - interval '40 seconds', now() - interval '39.9 seconds', NULL, NULL),
('stripe POST /webhooks/stripe', 'evt_unanswered', '\x00', NULL, NULL, NULL, now() - interval '30 seconds', NULL, NULL, NULL),
('stripe POST /webhooks/stripe', 'evt_crashed', '\x00', NULL, NULL, NULL, now() - interval '20 seconds', NULL, now() - interval '1 second', 1),
('stripe POST /webhooks/stripe', 'evt_working', '\x00', NULL, NULL, NULL, now() - interval '10 seconds', NULL, now() + interval '1 hour', 2),
('<b>evil</b>', $1, '\x00', 200, '{}', '<script>alert(3)</script>', now() - interval '5 seconds', now(), NULL, NULL)`, xssID)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO "` + name + `" (source, event_id, payload_digest, response_status, response_body, claimed_at, completed_at)
SELECT CASE WHEN g % 3 = 0 THEN 'github POST /webhooks/github' ELSE 'stripe POST /webhooks/stripe' END, 'evt_hist_' || g, '\x00', 200, '',
       now() - (g % 96) * interval '1 hour' - interval '1 minute', now() - (g % 96) * interval '1 hour' - interval '1 minute' + (g % 50) * interval '1 millisecond'
FROM generate_series(1, 3000) AS g`)
	require.NoError(t, err)
}

// serve mounts a UI on table under /admin/idem/ of a loopback server.
func serve(t *testing.T, table string, opts idemui.Options) string {
	t.Helper()
	opts.Table = table
	opts.Retention = 96 * time.Hour
	h, err := idemui.New(db, opts)
	require.NoError(t, err)
	t.Cleanup(h.Close)
	require.NoError(t, h.Refresh(context.Background()))
	mux := http.NewServeMux()
	mux.Handle("/admin/idem/", http.StripPrefix("/admin/idem", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/admin/idem/"
}

// browser starts headless Chromium with the flags of this machine kind and
// a new empty profile, and returns a tab's context.
func browser(t *testing.T) context.Context {
	t.Helper()
	path, err := exec.LookPath("chromium")
	require.NoError(t, err, "Debian's chromium is required: apt-get install -y chromium chromium-driver")
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1200, 900),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx)
	ctx, cancelTimeout := context.WithTimeout(ctx, 60*time.Second)
	t.Cleanup(func() { cancelTimeout(); cancelTab(); cancelAlloc() })
	require.NoError(t, chromedp.Do(ctx), "start chromium")
	return ctx
}

// shot keeps a screenshot of the whole page as name.png.
func shot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)) // quality 100: PNG
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(shotsDir, name+".png"), png, 0o644))
}

func keyURL(base, source, id string) string {
	return base + "key?" + url.Values{"source": {source}, "id": {id}}.Encode()
}

func TestInABrowser(t *testing.T) {
	shotsDir = os.Getenv("IDEM_SCREENSHOTS")
	if shotsDir == "" {
		var err error
		shotsDir, err = os.MkdirTemp("", "idemui-screenshots-")
		require.NoError(t, err)
	}
	require.NoError(t, os.MkdirAll(shotsDir, 0o755))
	t.Logf("screenshots in %s", shotsDir)

	newTable(t, "browser_keys")
	readOnly := serve(t, "browser_keys", idemui.Options{})
	ctx := browser(t)

	t.Run("the overview renders with its chart", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(readOnly), chromedp.WaitVisible(chromedp.CSS(`#chart`)))
		assert.GreaterOrEqual(t, eval[int](t, ctx, `document.querySelectorAll('#chart rect.bar').length`), 90, "a bar per hour with claims")
		assert.Contains(t, text(t, ctx, `#status`), "critical", "an unanswered key is critical")
		assert.Contains(t, text(t, ctx, `#sources`), "stripe POST /webhooks/stripe")
		assert.Greater(t, eval[float64](t, ctx, `document.querySelector('#chart').getBoundingClientRect().height`), 100.0,
			"the chart is drawn, styled by the embedded CSS")
		shot(t, ctx, "overview")
	})
	t.Run("the search finds an event id under every source, and opens the key", func(t *testing.T) {
		do(t, ctx,
			chromedp.Navigate(readOnly+"search"),
			chromedp.SendKeys(chromedp.CSS(`form.search input[name=id]`), "evt_1QxYz"),
			chromedp.Submit(chromedp.CSS(`form.search input[name=id]`)),
			chromedp.WaitVisible(chromedp.CSS(`#results`)),
		)
		results := text(t, ctx, `#results`)
		assert.Contains(t, results, "stripe POST /webhooks/stripe")
		assert.Contains(t, results, "github POST /webhooks/github")
		shot(t, ctx, "search")
		do(t, ctx, chromedp.Click(chromedp.CSS(`#results a`)), chromedp.WaitVisible(chromedp.CSS(`#state`)))
		assert.Contains(t, text(t, ctx, `#state`), "completed")
		assert.Contains(t, text(t, ctx, `#source`), "github POST /webhooks/github", "the newest first")
	})
	t.Run("a key's page shows its state", func(t *testing.T) {
		for id, want := range map[string]string{"evt_1QxYz": "completed", "evt_unanswered": "unanswered", "evt_crashed": "lease_expired", "evt_working": "leased"} {
			do(t, ctx, chromedp.Navigate(keyURL(readOnly, "stripe POST /webhooks/stripe", id)), chromedp.WaitVisible(chromedp.CSS(`#state`)))
			assert.Contains(t, text(t, ctx, `#state`), want, id)
		}
		do(t, ctx, chromedp.Navigate(keyURL(readOnly, "stripe POST /webhooks/stripe", "evt_1QxYz")), chromedp.WaitVisible(chromedp.CSS(`#state`)))
		assert.Contains(t, text(t, ctx, `main`), "hidden: this UI does not show bodies")
		shot(t, ctx, "key")
	})
	t.Run("the key <script>alert(1)</script> renders as text", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(keyURL(readOnly, "<b>evil</b>", xssID)), chromedp.WaitVisible(chromedp.CSS(`#event-id`)))
		assert.Equal(t, xssID, text(t, ctx, `#event-id`))
		assert.Equal(t, "<b>evil</b>", text(t, ctx, `#source`))
		assert.Zero(t, eval[int](t, ctx, noMarkup), "no element made of a key")
		shot(t, ctx, "xss")
		do(t, ctx, chromedp.Navigate(readOnly+"keys?state=all"), chromedp.WaitVisible(chromedp.CSS(`#keys`)))
		assert.Contains(t, text(t, ctx, `#keys`), xssID)
		assert.Zero(t, eval[int](t, ctx, noMarkup))
	})
	t.Run("read-only: no release", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(keyURL(readOnly, "stripe POST /webhooks/stripe", "evt_unanswered")), chromedp.WaitVisible(chromedp.CSS(`#state`)))
		assert.Zero(t, eval[int](t, ctx, `document.querySelectorAll('#release, form[action=release]').length`))
		do(t, ctx, chromedp.Navigate(readOnly+"release?source=x&id=y"))
		assert.Contains(t, text(t, ctx, `body`), "404")
	})

	withRelease := serve(t, "browser_keys", idemui.Options{AllowRelease: true})
	t.Run("release fails without its token", func(t *testing.T) {
		do(t, ctx,
			chromedp.Navigate(keyURL(withRelease, "stripe POST /webhooks/stripe", "evt_unanswered")),
			chromedp.Click(chromedp.CSS(`#release`)),
			chromedp.WaitVisible(chromedp.CSS(`#do-release`)),
		)
		eval[any](t, ctx, `document.querySelector('input[name=token]').remove()`)
		do(t, ctx, chromedp.Click(chromedp.CSS(`#do-release`)), chromedp.WaitVisible(chromedp.CSS(`p.message`)))
		body := text(t, ctx, `main`)
		assert.Contains(t, body, "Forbidden")
		assert.Contains(t, body, "token is missing")
		do(t, ctx, chromedp.Navigate(keyURL(withRelease, "stripe POST /webhooks/stripe", "evt_unanswered")), chromedp.WaitVisible(chromedp.CSS(`#state`)))
		assert.Contains(t, text(t, ctx, `#state`), "unanswered", "still there")
	})
	t.Run("release works with its token, after a confirmation", func(t *testing.T) {
		do(t, ctx,
			chromedp.Navigate(keyURL(withRelease, "stripe POST /webhooks/stripe", "evt_unanswered")),
			chromedp.Click(chromedp.CSS(`#release`)),
			chromedp.WaitVisible(chromedp.CSS(`#do-release`)),
			chromedp.SendKeys(chromedp.CSS(`input[name=reason]`), "INC-42"),
		)
		assert.Contains(t, text(t, ctx, `main`), "next delivery runs the handler again")
		shot(t, ctx, "release")
		do(t, ctx, chromedp.Click(chromedp.CSS(`#do-release`)), chromedp.WaitVisible(chromedp.CSS(`#released`)))
		assert.Contains(t, text(t, ctx, `#released`), "Released")
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM browser_keys WHERE event_id = 'evt_unanswered'`).Scan(&n))
		assert.Zero(t, n, "the key is gone")
	})
	t.Run("a live lease is refused in the browser as by the command", func(t *testing.T) {
		do(t, ctx,
			chromedp.Navigate(keyURL(withRelease, "stripe POST /webhooks/stripe", "evt_working")),
			chromedp.Click(chromedp.CSS(`#release`)),
			chromedp.WaitVisible(chromedp.CSS(`#do-release`)),
			chromedp.Click(chromedp.CSS(`#do-release`)),
			chromedp.WaitVisible(chromedp.CSS(`#refused`)),
		)
		refused := text(t, ctx, `#refused`)
		assert.Contains(t, refused, "live lease")
		assert.True(t, strings.Contains(refused, "force"))
	})
}

// noMarkup counts the elements a key's markup would have made: any
// script, and a b element holding "evil".
const noMarkup = `document.querySelectorAll('script').length + [...document.querySelectorAll('b')].filter(e => e.textContent === 'evil').length`

// do runs steps in the tab, failing the test on an error.
func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	require.NoError(t, chromedp.Do(ctx, steps...))
}

// text returns the visible text of the first element that matches sel.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	require.NoError(t, err)
	return s
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	require.NoError(t, err)
	return v
}
