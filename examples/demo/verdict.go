package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// verdict is what the database and the answers say about the run.
type verdict struct {
	events     int
	ledgerRows int
	doubled    []string // events with more than one ledger row
	missing    []string // events with none

	originals      int      // answers from a run of the handler (2xx, not replayed)
	wrongOriginals []string // events without exactly one original, or whose original names another row
	replays        int
	replaysDiffer  int // replays not identical to their event's original
	unanswered     int // deliveries whose last answer was not 2xx

	reusedSent, reused422 int
}

func (v verdict) pass() bool {
	return v.ledgerRows == v.events && len(v.doubled) == 0 && len(v.missing) == 0 &&
		len(v.wrongOriginals) == 0 && v.replaysDiffer == 0 && v.unanswered == 0 &&
		v.reused422 == v.reusedSent
}

// judge counts the ledger rows of every event id in the database and checks
// every answer against them.
func judge(ctx context.Context, db *sql.DB, rc *receiver, st *storm) (verdict, error) {
	v := verdict{events: len(st.events)}
	type rows struct{ n, firstID int64 }
	byEvent := map[string]rows{}
	q, err := db.QueryContext(ctx, `SELECT event_id, count(*), min(id) FROM `+rc.ledger+` GROUP BY event_id`)
	if err != nil {
		return v, err
	}
	defer q.Close()
	for q.Next() {
		var id string
		var r rows
		if err := q.Scan(&id, &r.n, &r.firstID); err != nil {
			return v, err
		}
		byEvent[id] = r
		v.ledgerRows += int(r.n)
	}
	if err := q.Err(); err != nil {
		return v, err
	}

	for _, e := range st.events {
		r := byEvent[e.id]
		switch {
		case r.n == 0:
			v.missing = append(v.missing, e.id)
		case r.n > 1:
			v.doubled = append(v.doubled, e.id)
		}
		var original *answer
		originals := 0
		for i, a := range e.answers {
			switch {
			case !a.ok():
				v.unanswered++
			case !a.replayed:
				originals++
				original = &e.answers[i]
			}
		}
		v.originals += originals
		if originals != 1 || ledgerID(original.body) != r.firstID {
			v.wrongOriginals = append(v.wrongOriginals, e.id)
		}
		for _, a := range e.answers {
			if a.ok() && a.replayed {
				v.replays++
				if original == nil || a.status != original.status || !bytes.Equal(a.body, original.body) {
					v.replaysDiffer++
				}
			}
		}
		if e.reused != nil {
			v.reusedSent++
			if e.reusedAnswer.status == 422 {
				v.reused422++
			}
		}
	}
	return v, nil
}

// ledgerID reads the ledger row id from an answer of the orders handler.
func ledgerID(body []byte) int64 {
	var a struct {
		LedgerID int64 `json:"ledger_id"`
	}
	_ = json.Unmarshal(body, &a)
	return a.LedgerID
}

// report prints the summary table and the verdict.
func report(w io.Writer, cfg config, rc *receiver, res result, v verdict) {
	planned := int64(cfg.events*cfg.deliveries + v.reusedSent)
	var table bytes.Buffer
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	row := func(name string, value any, note string) { fmt.Fprintf(tw, "  %s\t%v\t%s\n", name, value, note) }
	fmt.Fprintln(w)
	row("deliveries sent", res.sent, fmt.Sprintf("%d events × %d, %d with a reused id, %d retries", cfg.events, cfg.deliveries, v.reusedSent, res.sent-planned))
	row("distinct events", v.events, "")
	row("ledger rows written", v.ledgerRows, "counted per event id in the database")
	row("handler runs (201)", v.originals, "answers not marked Idempotent-Replayed; the reused ids are the 422 row")
	row("replays", v.replays, fmt.Sprintf("%d of them differ from their original; %d waited for it first", v.replaysDiffer, rc.waitedReplays.Load()))
	row("409 in flight", res.conflicts, "each retried after Retry-After")
	row("422 reused id", v.reused422, fmt.Sprintf("of %d deliveries reusing an id with another body", v.reusedSent))
	row("5xx or no answer", res.errs, "each retried")
	row("latency p50 / p99", fmt.Sprintf("%v / %v", round(percentile(res.latencies, 50)), round(percentile(res.latencies, 99))), "per request, retries included")
	row("wall time", round(res.wall), "")
	_ = tw.Flush()
	for _, line := range strings.Split(strings.TrimSuffix(table.String(), "\n"), "\n") {
		fmt.Fprintln(w, strings.TrimRight(line, " "))
	}
	fmt.Fprintln(w)

	if v.pass() {
		fmt.Fprintf(w, "VERDICT: PASS — %d events, %d ledger rows (one per event), %d replays identical to their originals, %d/%d reused ids refused with 422.\n",
			v.events, v.ledgerRows, v.replays, v.reused422, v.reusedSent)
		return
	}
	fmt.Fprintln(w, "VERDICT: FAIL")
	if v.ledgerRows != v.events || len(v.doubled) > 0 || len(v.missing) > 0 {
		fmt.Fprintf(w, "  - %d ledger rows for %d events: %d events written more than once%s, %d never%s\n",
			v.ledgerRows, v.events, len(v.doubled), some(v.doubled), len(v.missing), some(v.missing))
	}
	if len(v.wrongOriginals) > 0 {
		fmt.Fprintf(w, "  - %d events without exactly one original answer naming their ledger row%s\n", len(v.wrongOriginals), some(v.wrongOriginals))
	}
	if v.replaysDiffer > 0 {
		fmt.Fprintf(w, "  - %d replays differ from their original\n", v.replaysDiffer)
	}
	if v.unanswered > 0 {
		fmt.Fprintf(w, "  - %d deliveries never got a 2xx answer\n", v.unanswered)
	}
	if v.reused422 != v.reusedSent {
		fmt.Fprintf(w, "  - %d of %d deliveries reusing an id with another body were accepted instead of refused with 422\n", v.reusedSent-v.reused422, v.reusedSent)
	}
}

// some lists the first few ids, for a failure line.
func some(ids []string) string {
	if len(ids) == 0 {
		return ""
	}
	if len(ids) > 3 {
		return " (" + strings.Join(ids[:3], ", ") + ", …)"
	}
	return " (" + strings.Join(ids, ", ") + ")"
}

// round keeps durations readable.
func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}
