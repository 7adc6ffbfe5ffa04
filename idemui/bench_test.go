package idemui_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/stretchr/testify/require"
)

// BenchmarkPagesOn1MKeys renders each page against a table of 1,000,000
// keys (20 sources over 30 days; 100 unanswered, 100 expired and 100 live
// leases among them), plain and partitioned by day, and reports each
// page's p50 and p95 in milliseconds (docs/operator-ui.md has the
// numbers). Not part of the test command: setting up the table takes
// seconds. Run it with
//
//	go test -run '^$' -bench PagesOn1MKeys -benchtime 100x ./idemui
func BenchmarkPagesOn1MKeys(b *testing.B) {
	for _, layout := range []struct {
		name     string
		interval time.Duration
	}{{"plain", 0}, {"partitioned", 24 * time.Hour}} {
		b.Run(layout.name, func(b *testing.B) {
			table := fmt.Sprintf("bench_%s_%d", layout.name, tableSeq.Add(1))
			start := time.Now()
			fillMillion(b, table, layout.interval)
			b.Logf("%s: 1M keys written in %v", table, time.Since(start).Round(time.Millisecond))

			h, err := idemui.New(db, idemui.Options{Table: table, AllowRelease: true, RefreshEvery: time.Hour})
			require.NoError(b, err)
			defer h.Close()
			for i := range 3 {
				start = time.Now()
				require.NoError(b, h.Refresh(context.Background()))
				b.Logf("%s: snapshot %d taken in %v", table, i+1, time.Since(start).Round(time.Millisecond))
			}

			key := url.Values{"source": {"source_07"}, "id": {"evt_500007"}}.Encode()
			for _, p := range []struct{ name, path string }{
				{"overview", "/"},
				{"key", "/key?" + key},
				{"search-id-alone", "/search?id=evt_500007"},
				{"search-missing-id", "/search?id=evt_none"},
				{"list-stuck", "/keys?state=stuck"},
				{"list-all", "/keys?state=all"},
				{"list-one-source", "/keys?state=all&source=source_03"},
				{"release-confirm", "/release?" + key},
			} {
				b.Run(p.name, func(b *testing.B) {
					b.ReportAllocs()
					times := make([]time.Duration, 0, b.N)
					for b.Loop() {
						rec := httptest.NewRecorder()
						t0 := time.Now()
						h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, p.path, nil))
						times = append(times, time.Since(t0))
						if rec.Code != http.StatusOK {
							b.Fatalf("%s: %d %s", p.path, rec.Code, rec.Body.String())
						}
					}
					slices.Sort(times)
					b.ReportMetric(ms(times[len(times)/2]), "p50-ms")
					b.ReportMetric(ms(times[(len(times)*95+99)/100-1]), "p95-ms")
				})
			}
		})
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fillMillion migrates table and writes 1,000,000 keys into it in one
// INSERT ... SELECT generate_series: source_00 to source_19 over the last 30
// days, oldest first, completed a few milliseconds after their claim, but
// for every 10,000th key without an answer, under an expired lease and
// under a live one.
func fillMillion(b *testing.B, table string, interval time.Duration) {
	b.Helper()
	ctx := context.Background()
	require.NoError(b, idem.MigrateWith(ctx, db, idem.MigrateOptions{Table: table, PartitionInterval: interval}))
	if interval > 0 { // partitions for the 30 days back, as if it had run that long
		_, err := db.ExecContext(ctx, `DO $$
DECLARE d timestamptz;
BEGIN
  FOR i IN 1..31 LOOP
    d := date_trunc('day', now()) - i * interval '1 day';
    EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)', '`+table+`_back_' || i, '`+table+`', d, d + interval '1 day');
    EXECUTE format('ALTER TABLE %I ADD PRIMARY KEY (source, event_id)', '`+table+`_back_' || i);
  END LOOP;
END $$`)
		require.NoError(b, err)
	}
	_, err := db.ExecContext(ctx, `INSERT INTO "`+table+`" (source, event_id, payload_digest, response_status, response_headers, response_body,
    claimed_at, completed_at, lease_until, lease_token)
SELECT 'source_' || lpad((g % 20)::text, 2, '0'), 'evt_' || g, '\x00',
       CASE WHEN g % 10000 IN (1, 2, 3) THEN NULL ELSE 200 END, '{}', CASE WHEN g % 10000 IN (1, 2, 3) THEN NULL ELSE '{"ok":true}'::bytea END,
       c, CASE WHEN g % 10000 IN (1, 2, 3) THEN NULL ELSE c + (g % 97) * interval '1 millisecond' END,
       CASE g % 10000 WHEN 2 THEN c + interval '1 minute' WHEN 3 THEN now() + interval '1 hour' END,
       CASE WHEN g % 10000 IN (2, 3) THEN g END
FROM generate_series(1, 1000000) AS g, LATERAL (SELECT now() - interval '30 days' + g * interval '2592 milliseconds' - interval '1 second') AS x(c)`)
	require.NoError(b, err)
	_, err = db.ExecContext(ctx, `VACUUM ANALYZE "`+table+`"`)
	require.NoError(b, err)
}
